"""Write a benchmark's results: `results.json`, `report.md` and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tokenmill.bench.plots import write_plots

DEFINITIONS = """\
## Definitions

- **TTFT**: time from sending the request to the first SSE chunk carrying generated text.
- **ITL**: gaps between consecutive content-bearing SSE chunks; a chunk carrying k tokens
  is one arrival. Run-level ITL percentiles pool every gap of every successful request.
- **E2E**: time from sending the request to the end of its stream.
- **Output tokens**: `usage.completion_tokens` from the final stream chunk
  (`stream_options.include_usage`); where a server sends no usage, content chunks are
  counted instead (see `usage_source` in results.json).
- **Decode tokens/s per stream**: (output tokens - 1) / (E2E - TTFT), per request.
- **Throughputs** (tokens/s, requests/s) divide by the run's wall time, first send to last
  completion.
- **Goodput**: successful requests per second whose TTFT <= the TTFT objective **and** whose
  **mean** ITL <= the ITL objective (an objective not given is not checked).
- **Cached**: the share of prompt tokens the server's prefix cache served, from
  `usage.prompt_tokens_details.cached_tokens` ("-" where the server does not report it).
"""


def _f(x: Optional[float], nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0%}"


def _by_turn(runs: list[dict[str, Any]]) -> list[str]:
    """Agent runs: one row per run and turn, so first turns (cold history) and later ones
    (history the cache may still hold) can be told apart."""
    rows = [(r["label"], t, v) for r in runs for t, v in (r.get("by_turn") or {}).items()]
    if not rows:
        return []
    lines = ["## By turn", "", "| run | turn | requests | TTFT p50 | TTFT p99 | cached |", "|---|---|---|---|---|---|"]
    lines += [f"| {label} | {t} | {v['requests']} | {_f(v['ttft_ms']['p50'])} | {_f(v['ttft_ms']['p99'])} "
              f"| {_pct(v['cached_token_share'])} |" for label, t, v in rows]
    return lines + [""]


def _slo_text(slo: dict[str, Any]) -> str:
    parts = []
    if slo.get("ttft_ms") is not None:
        parts.append(f"TTFT <= {slo['ttft_ms']:g} ms")
    if slo.get("itl_ms") is not None:
        parts.append(f"mean ITL <= {slo['itl_ms']:g} ms")
    return " and ".join(parts) if parts else "none given (goodput = requests/s)"


def markdown(results: dict[str, Any], plots: list[Path]) -> str:
    """The human report: setup, one summary table, errors, definitions, plots."""
    meta = results["meta"]
    lines = [
        "# Benchmark report",
        "",
        f"- target: `{meta['base_url']}` model `{meta['model']}` endpoint `{meta['endpoint']}`",
        f"- started: {meta['started_at']}; seed {meta['seed']}; ignore_eos {meta.get('ignore_eos')}; "
        f"temperature {meta.get('temperature')}",
        f"- workload: {meta.get('workload_desc', '')}",
        f"- objectives for goodput: {_slo_text(meta['slo'])}",
        f"- command: `{meta['command']}`",
        "",
        "## Summary",
        "",
        "| run | ok/sent | req/s | goodput req/s | out tok/s | total tok/s | TTFT p50 | TTFT p99 "
        "| ITL p50 | ITL p99 | E2E p50 | decode tok/s/stream p50 | cached |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['label']} | {r['num_ok']}/{r['num_requests']} | {_f(r['requests_per_s'], 2)} "
            f"| {_f(r['goodput_rps'], 2)} | {_f(r['output_tokens_per_s'])} | {_f(r['total_tokens_per_s'])} "
            f"| {_f(r['ttft_ms']['p50'])} | {_f(r['ttft_ms']['p99'])} | {_f(r['itl_ms']['p50'])} "
            f"| {_f(r['itl_ms']['p99'])} | {_f(r['e2e_ms']['p50'])} "
            f"| {_f(r['decode_tokens_per_s_per_stream']['p50'])} | {_pct(r.get('cached_token_share'))} |")
    lines += ["", "Latencies in ms.", ""]
    lines += _by_turn(results["runs"])
    errs = [(r["label"], r["errors_by_kind"]) for r in results["runs"] if r["errors_by_kind"]]
    if errs:
        lines += ["## Errors", ""]
        lines += [f"- {label}: " + ", ".join(f"{k} x{v}" for k, v in kinds.items()) for label, kinds in errs]
        lines.append("")
    chunked = [r["label"] for r in results["runs"] if r.get("usage_source", {}).get("chunks")]
    if chunked:
        lines += [f"Note: the server sent no usage for some requests in {', '.join(chunked)}; "
                  "their output tokens were counted as content chunks.", ""]
    lines.append(DEFINITIONS)
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def write_results(results: dict[str, Any], out_dir: Path, with_plots: bool = True) -> dict[str, Path]:
    """Write results.json, the plots and report.md into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"results": out_dir / "results.json", "report": out_dir / "report.md"}
    paths["results"].write_text(json.dumps(results, indent=1) + "\n")
    plots = write_plots(results, out_dir) if with_plots else []
    paths["report"].write_text(markdown(results, plots))
    for p in plots:
        paths[p.stem] = p
    return paths
