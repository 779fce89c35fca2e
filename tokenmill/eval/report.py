"""What an eval run measured, per configuration: results.json, a markdown table, a plot.

Per configuration: successes out of tasks with a 95% Wilson interval, tokens, request
latency percentiles, machine time, and the cost per successful task two ways:

- **card**: every request priced with the rate card (tokenmill.cost.price, what a
  provider billing per token would charge, failed tasks included), divided by the
  number of successful tasks;
- **machine**: `usd_per_hour` times the time the run kept the server busy (first request
  sent to last answer received), divided by the number of successful tasks. A
  per-token card prices a slow run and a fast run the same; a self-hosted machine is
  paid by the hour.

Zero successes make both costs per success undefined (reported as none).
"""

from __future__ import annotations

import math
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

from tokenmill.bench.stats import summarize
from tokenmill.cost import RateCard, price
from tokenmill.eval.runner import TargetRun

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def summary(run: TargetRun, card: RateCard, usd_per_hour: Optional[float]) -> dict[str, Any]:
    answers = run.answers
    n, ok = len(answers), sum(a.passed for a in answers)
    lo, hi = wilson(ok, n)
    by_kind: dict[str, dict[str, int]] = {}
    for a in answers:
        k = by_kind.setdefault(a.kind, {"tasks": 0, "passed": 0})
        k["tasks"] += 1
        k["passed"] += a.passed
    priced = [a for a in answers if a.prompt_tokens is not None and a.completion_tokens is not None]
    card_usd = sum((price(card, input_tokens=a.prompt_tokens, cached_tokens=min(a.cached_tokens, a.prompt_tokens),
                          output_tokens=a.completion_tokens).total_usd for a in priced), Decimal(0))
    machine_usd = None if usd_per_hour is None else Decimal(str(usd_per_hour)) * Decimal(run.busy_s) / 3600
    per_ok = lambda usd: None if usd is None or ok == 0 else float(usd / ok)  # noqa: E731
    return {
        "label": run.target.label,
        "base_url": run.target.base_url,
        "model": run.model,
        "tasks": n,
        "passed": ok,
        "success_rate": ok / n if n else 0.0,
        "success_ci95": [lo, hi],
        "by_kind": by_kind,
        "request_errors": sum(not a.ok for a in answers),
        "check_errors": sum(a.check_error for a in answers),
        "prompt_tokens": sum(a.prompt_tokens or 0 for a in answers),
        "completion_tokens": sum(a.completion_tokens or 0 for a in answers),
        "unpriced_answers": n - len(priced),  # no usage in the reply
        "latency_s": summarize([a.latency_s for a in answers if a.ok]),
        "machine_s": run.busy_s,
        "card": card.name,
        "card_usd": float(card_usd),
        "card_usd_per_success": per_ok(card_usd),
        "usd_per_hour": usd_per_hour,
        "machine_usd": None if machine_usd is None else float(machine_usd),
        "machine_usd_per_success": per_ok(machine_usd),
    }


def _usd(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"${x:.3g}" if x < 0.01 else f"${x:.4f}"


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def table(results: dict[str, Any]) -> str:
    """One row per configuration (markdown)."""
    lines = ["| configuration | model | passed | success (95% CI) | prompt / completion tokens "
             "| latency p50 / p90 / p99 ms | machine s | card $/success | machine $/success |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in results["configs"]:
        lo, hi = s["success_ci95"]
        lat = s["latency_s"]
        lines.append(
            f"| {s['label']} | {s['model']} | {s['passed']}/{s['tasks']} "
            f"| {s['success_rate']:.0%} ({lo:.0%}-{hi:.0%}) | {s['prompt_tokens']} / {s['completion_tokens']} "
            f"| {_ms(lat['p50'])} / {_ms(lat['p90'])} / {_ms(lat['p99'])} | {s['machine_s']:.1f} "
            f"| {_usd(s['card_usd_per_success'])} | {_usd(s['machine_usd_per_success'])} |")
    return "\n".join(lines)


def markdown(results: dict[str, Any], plot: Optional[str]) -> str:
    meta = results["meta"]
    out = [f"# Eval: suite `{meta['suite']}` ({meta['tasks']} tasks)", "",
           f"- command: `{meta['command']}`", f"- started: {meta['started_at']}",
           f"- requests: temperature {meta['temperature']}, concurrency {meta['concurrency']}"
           + (", JSON tasks with response_format" if meta.get("structured") else ""),
           f"- rate card: {', '.join(sorted({s['card'] for s in results['configs']}))}; machine price: "
           + (f"${meta['usd_per_hour']}/hour" if meta.get("usd_per_hour") is not None else "not given"),
           f"- sandbox: {meta.get('sandbox', '')}", "", table(results), ""]
    for s in results["configs"]:
        errs = []
        if s["request_errors"]:
            errs.append(f"{s['request_errors']} request(s) failed")
        if s["check_errors"]:
            errs.append(f"{s['check_errors']} answer(s) could not be checked (sandbox error)")
        kinds = ", ".join(f"{k} {v['passed']}/{v['tasks']}" for k, v in sorted(s["by_kind"].items()))
        out.append(f"- {s['label']}: {kinds}" + (f"; {'; '.join(errs)}" if errs else ""))
    out += ["", "Card $/success: every request priced with the rate card, over successful tasks. "
            "Machine $/success: the machine's price per hour times the time the run kept the server busy, "
            "over successful tasks. Success intervals are 95% Wilson score intervals."]
    if plot:
        out += ["", f"![success and cost]({plot})"]
    return "\n".join(out) + "\n"


def write_plot(results: dict[str, Any], path: Path) -> Path:
    """Success rate (with its interval) and each cost per successful task, per configuration."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    configs = results["configs"]
    labels = [s["label"] for s in configs]
    x = list(range(len(configs)))
    costs = [(key, title, color) for key, title, color in
             (("card_usd_per_success", "rate card USD\nper successful task", "#dd8452"),
              ("machine_usd_per_success", "machine-time USD\nper successful task", "#55a868"))
             if any(s[key] is not None for s in configs)]
    fig = Figure(figsize=(3.2 * (1 + len(costs)) + 0.6 * len(configs), 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1 + len(costs), squeeze=False)[0]
    rates = [s["success_rate"] for s in configs]
    err = [[r - s["success_ci95"][0] for r, s in zip(rates, configs)],
           [s["success_ci95"][1] - r for r, s in zip(rates, configs)]]
    axes[0].bar(x, rates, yerr=err, capsize=6, color="#4c72b0")
    axes[0].set(title="success rate\n(95% Wilson interval)", ylim=(0, 1))
    for ax, (key, title, color) in zip(axes[1:], costs):
        vals = [s[key] if s[key] is not None else 0.0 for s in configs]  # 0: nothing succeeded
        ax.bar(x, vals, color=color)
        ax.set(title=title)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
