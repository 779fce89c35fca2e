"""The comparison table of `benchmarks/compare` and its block in docs/benchmarks.md."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

# (key, label, higher is better)
METRICS: tuple[tuple[str, str, bool], ...] = (
    ("decode_c1", "single-stream decode tok/s (c=1, p50)", True),
    ("ttft_p50_c1", "TTFT p50 ms (c=1)", False),
    ("ttft512", "TTFT p50 ms, 512-token prompt (c=1)", False),
    ("ttft_p99_c1", "TTFT p99 ms (c=1)", False),
    ("ttft_p50_c16", "TTFT p50 ms (c=16)", False),
    ("ttft_p99_c16", "TTFT p99 ms (c=16)", False),
    ("out_tps_c1", "output tok/s (c=1)", True),
    ("out_tps_c4", "output tok/s (c=4)", True),
    ("out_tps_c16", "output tok/s (c=16)", True),
)

BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"


def metrics_of(results: dict[str, Any]) -> dict[str, Optional[float]]:
    """The table's numbers from one server's results, plus sanity counts."""
    by_c = {r["concurrency"]: r for r in results["runs"]}
    get = lambda c, *path: _dig(by_c.get(c), path)  # noqa: E731
    out: dict[str, Optional[float]] = {
        "decode_c1": get(1, "decode_tokens_per_s_per_stream", "p50"),
        "ttft_p50_c1": get(1, "ttft_ms", "p50"), "ttft_p99_c1": get(1, "ttft_ms", "p99"),
        "ttft_p50_c16": get(16, "ttft_ms", "p50"), "ttft_p99_c16": get(16, "ttft_ms", "p99"),
        "out_tps_c1": get(1, "output_tokens_per_s"), "out_tps_c4": get(4, "output_tokens_per_s"),
        "out_tps_c16": get(16, "output_tokens_per_s"),
    }
    runs = results["runs"]
    out["requests"] = float(sum(r["num_requests"] for r in runs))
    out["errors"] = float(sum(r["num_errors"] for r in runs))
    out["short_outputs"] = float(sum(r.get("num_short_outputs", 0) for r in runs))
    ok = sum(r["num_ok"] for r in runs)
    out["mean_output_tokens"] = sum(r["output_tokens_total"] for r in runs) / ok if ok else None
    return out


def ttft_p50(results: dict[str, Any]) -> Optional[float]:
    """The long-prompt TTFT runs' median (benchmarks/race/compare.py puts them under "ttft")."""
    runs = results.get("ttft") or []
    return _dig(runs[0], ("ttft_ms", "p50")) if runs else None


def engine_table(engine: dict[str, dict[str, Any]]) -> str:
    """Markdown: per format, llama-bench's pp512 / tg128 beside tokenmill's offline engine."""
    lines = ["| format | tokenmill runs it as | pp512 tok/s: tokenmill | llama-bench | ratio "
             "| tg128 tok/s: tokenmill | llama-bench | ratio |", "|---|---|---|---|---|---|---|---|"]
    for fmt, row in engine.items():
        tm, lb = row.get("tokenmill", {}), row.get("llama-bench", {})
        cells = [fmt, tm.get("quantization", "-")]
        for key in ("pp512", "tg128"):
            a, b = tm.get(key), lb.get(key)
            cells += [_fmt(a), _fmt(b), f"{a / b:.2f}x" if a and b else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_metrics(reps: list[dict[str, Optional[float]]]) -> dict[str, Optional[float]]:
    """Each metric's median over repeats (counts are summed)."""
    out: dict[str, Optional[float]] = {}
    for key in reps[0]:
        vals = sorted(v for r in reps if (v := r.get(key)) is not None)
        if key in ("requests", "errors", "short_outputs"):
            out[key] = float(sum(vals))
        else:
            out[key] = statistics.median(vals) if vals else None
    return out


def _dig(d: Any, path: tuple[str, ...]) -> Optional[float]:
    for key in path:
        if not isinstance(d, dict) or d.get(key) is None:
            return None
        d = d[key]
    return float(d)


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def ratio_table(metrics: dict[str, dict[str, Optional[float]]]) -> str:
    """Markdown: a row per metric, absolute values per server, then tokenmill / peer."""
    names = list(metrics)
    peers = [n for n in names if n != "tokenmill"]
    have_tm = "tokenmill" in metrics
    head = ["metric", *names] + ([f"tokenmill / {p}" for p in peers] if have_tm else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, _higher in METRICS:
        row = [label] + [_fmt(metrics[n].get(key)) for n in names]
        if have_tm:
            tm = metrics["tokenmill"].get(key)
            for p in peers:
                v = metrics[p].get(key)
                row.append(f"{tm / v:.2f}x" if tm is not None and v else "-")
        lines.append("| " + " | ".join(row) + " |")
    extra = [("mean output tokens per request", "mean_output_tokens"), ("errors / requests", None)]
    for label, key in extra:
        if key:
            row = [label] + [_fmt(metrics[n].get(key)) for n in names]
        else:
            row = [label] + [f"{metrics[n]['errors']:.0f} / {metrics[n]['requests']:.0f}" for n in names]
        lines.append("| " + " | ".join(row + ([""] * len(peers) if have_tm else [])) + " |")
    return "\n".join(lines)


def docs_block(sections: list[tuple[str, str]], command: str, when: str, machine: str, workload: dict[str, Any],
               notes: dict[str, str], skipped: dict[str, str], quick: bool, repeat: int = 1) -> str:
    """The generated block: how it was run, then a (heading, table) per section."""
    lines = [
        BEGIN,
        f"### Latest comparison ({'quick' if quick else 'full'} run, {when})",
        "",
        f"Command: `{command}`",
        "",
        f"- machine: {machine}",
        f"- workload: {workload.get('workload_desc', '')}; closed loop at concurrency 1, 4, 16; "
        f"greedy; seed {workload.get('seed')}; 2 unrecorded warm-up requests per server start; then "
        f"fresh 512-token prompts one at a time for TTFT"
        + (f"; each metric is the median of {repeat} repeats, interleaved (each repeat starts every "
           f"server afresh, servers taking turns going first)" if repeat > 1 else ""),
        "- ratios are tokenmill / peer: above 1 is better for tok/s rows, below 1 is better for TTFT rows",
    ]
    lines += [f"- {name}: {note}" for name, note in notes.items()]
    lines += [f"- not measured: {name}: {why}" for name, why in skipped.items()]
    for heading, table in sections:
        lines += ["", f"#### {heading}", "", table]
    lines += ["", END]
    return "\n".join(lines)


def write_docs(path: Path, block: str) -> None:
    """Replace the generated block in docs/benchmarks.md (or append it)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
