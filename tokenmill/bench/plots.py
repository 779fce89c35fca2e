"""PNG plots of a results dict (matplotlib's object API: no pyplot global state).

- `latency_cdf.png`: CDFs of TTFT, ITL and E2E, one line per run;
- `throughput.png`: output tokens/s, requests/s and goodput against concurrency or rate;
- `latency_vs_load.png`: TTFT and ITL p50/p99 against concurrency or rate.

Closed-loop and open-loop runs have different x axes, so each mode gets its own file
(`*_closed.png`, `*_open.png`) for the two load plots.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _ok(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["requests"] if r["ok"]]


def latency_cdf(results: dict[str, Any], path: Path) -> Path:
    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    getters = {
        "TTFT (ms)": lambda reqs: [r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None],
        "ITL (ms)": lambda reqs: [g for r in reqs for g in r["itl_ms"]],
        "E2E latency (ms)": lambda reqs: [r["e2e_ms"] for r in reqs if r["e2e_ms"] is not None],
    }
    for ax, (title, get) in zip(axes, getters.items()):
        for run in results["runs"]:
            vals = np.sort(np.asarray(get(_ok(run)), dtype=float))
            if len(vals):
                ax.plot(vals, np.arange(1, len(vals) + 1) / len(vals), label=run["label"])
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    model = os.path.basename(str(results["meta"].get("model")))
    fig.suptitle(f"Latency CDFs: {model} @ {results['meta'].get('base_url')}")
    return _save(fig, path)


def _load_axis(runs: list[dict[str, Any]], mode: str) -> tuple[list[float], str]:
    if mode == "closed":
        return [r["concurrency"] for r in runs], "concurrency"
    return [r["request_rate"] for r in runs], "request rate (req/s)"


def _x_axis(ax: Any, xs: list[float], mode: str) -> None:
    """Concurrency sweeps double: a log2 axis labelled with the plain values."""
    if mode == "closed" and min(xs) > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
    ax.grid(alpha=0.3)


def throughput(runs: list[dict[str, Any]], mode: str, path: Path) -> Path:
    xs, xlabel = _load_axis(runs, mode)
    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(xs, [r["output_tokens_per_s"] for r in runs], "o-", label="output tokens/s")
    ax1.plot(xs, [r["total_tokens_per_s"] for r in runs], "s--", label="total tokens/s")
    ax1.set_ylabel("tokens/s")
    ax2.plot(xs, [r["requests_per_s"] for r in runs], "o-", label="requests/s")
    ax2.plot(xs, [r["goodput_rps"] for r in runs], "s--", label="goodput (req/s)")
    ax2.set_ylabel("requests/s")
    for ax in (ax1, ax2):
        ax.set_xlabel(xlabel)
        _x_axis(ax, xs, mode)
        ax.legend(fontsize=8)
    fig.suptitle(f"Throughput vs {xlabel}")
    return _save(fig, path)


def latency_vs_load(runs: list[dict[str, Any]], mode: str, path: Path) -> Path:
    xs, xlabel = _load_axis(runs, mode)
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "ITL (ms)")):
        for pct, style in (("p50", "o-"), ("p99", "s--")):
            ys = [r[key][pct] if r[key][pct] is not None else np.nan for r in runs]
            ax.plot(xs, ys, style, label=pct)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(title)
        _x_axis(ax, xs, mode)
        ax.legend(fontsize=8)
    fig.suptitle(f"Latency vs {xlabel}")
    return _save(fig, path)


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every plot that the runs support; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [latency_cdf(results, out_dir / "latency_cdf.png")]
    for mode in ("closed", "open"):
        runs = [r for r in results["runs"] if r["mode"] == mode]
        if runs:
            written.append(throughput(runs, mode, out_dir / f"throughput_{mode}.png"))
            written.append(latency_vs_load(runs, mode, out_dir / f"latency_vs_load_{mode}.png"))
    return written
