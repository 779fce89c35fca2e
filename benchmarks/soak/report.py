"""The soak's verdict (its thresholds are here), its markdown table over time, its JSON
and, where matplotlib is installed, a PNG of the sampled figures."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from benchmarks.soak.traffic import EXPECTED

# Growth allowed between the end of the warm-up and the end of the run: a floor (what
# allocator and page-cache noise can move on their own, which dominates a short run)
# plus a rate (what a leak would add over the run; an hour's soak allows the floor + the
# rate).
RSS_FLOOR_MIB = 48.0
RSS_MIB_PER_HOUR = 64.0
FDS_FLOOR = 16
FDS_PER_HOUR = 8
FAULT_END_BOUND_S = 5.0  # a request caught in an engine kill ends (with an error) within this (a stop: plus the hang bound)
FAULT_RECOVERY_BOUND_S = 120.0  # the first good answer after an engine kill comes within this


def allowed(floor: float, per_hour: float, seconds: float) -> float:
    return floor + per_hour * seconds / 3600


def verdict(samples: list[dict], outcomes: list[Any], faults: list[dict], warm_index: int) -> list[str]:
    """Why the soak failed (an empty list: it passed)."""
    why = []
    bad = Counter(o.status for o in outcomes if o.status not in EXPECTED)
    if bad:
        why.append(f"unexpected outcomes: {dict(bad)}")
    if len(samples) > warm_index:
        a, b = samples[warm_index], samples[-1]
        span = b["t_s"] - a["t_s"]
        for name, key, floor, rate in (("resident memory (MiB)", "rss_mib", RSS_FLOOR_MIB, RSS_MIB_PER_HOUR),
                                       ("open descriptors", "fds", FDS_FLOOR, FDS_PER_HOUR)):
            grew, cap = b[key] - a[key], allowed(floor, rate, span)
            if grew > cap:
                why.append(f"{name} grew {grew:.1f} from {a['t_s']:.0f} s to {b['t_s']:.0f} s (allowed {cap:.1f})")
    if samples and samples[-1]["kv_blocks_idle"] not in (0, None):
        why.append(f"{samples[-1]['kv_blocks_idle']} KV blocks held with nothing running at the end")
    for f in faults:
        sig, bound = f.get("signal", "SIGKILL"), f.get("end_bound_s", FAULT_END_BOUND_S)
        if f.get("recovered_s") is None or f["recovered_s"] > FAULT_RECOVERY_BOUND_S:
            why.append(f"no good answer within {FAULT_RECOVERY_BOUND_S:.0f} s of the engine's {sig} "
                       f"at {f['t_s']:.0f} s")
        if f.get("caught_end_max_s") is not None and f["caught_end_max_s"] > bound:
            why.append(f"a request caught in the engine's {sig} took {f['caught_end_max_s']:.1f} s to end "
                       f"(bound {bound:.0f} s)")
    return why


def _f(v: Optional[float], fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def table(samples: list[dict]) -> str:
    head = ("| t (min) | RSS server / engine / all (MiB) | fds | threads | KV blocks idle | data dir / SQLite (MiB) "
            "| client loop lag p99 / max (ms) | server loop lag max (ms) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
            "| ok | other outcomes |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in samples:
        p = s["processes"]
        errors = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()) if k != "ok") or "-"
        rows.append(
            f"| {s['t_s'] / 60:.1f} | {_f(p.get('server', {}).get('rss_mib'))} / "
            f"{_f(p.get('engine', {}).get('rss_mib'))} / {_f(s['rss_mib'])} | {s['fds']} | {s['threads']} "
            f"| {_f(s['kv_blocks_idle'])} | {_f(s['data_mib'], '.2f')} / {_f(s['sqlite_mib'], '.2f')} "
            f"| {_f(s['client_lag']['p99_ms'], '.1f')} / {_f(s['client_lag']['max_ms'], '.1f')} "
            f"| {_f(s['server_lag_max_ms'], '.1f')} | {_f(s['ttft_p50_ms'])} / {_f(s['ttft_p99_ms'])} "
            f"| {_f(s['itl_p50_ms'])} / {_f(s['itl_p99_ms'])} | {s['outcomes'].get('ok', 0)} | {errors} |")
    return "\n".join(rows)


def summary(outcomes: list[Any], faults: list[dict], why: list[str], minutes: float) -> str:
    by = Counter(o.status for o in outcomes)
    kinds = Counter(o.kind for o in outcomes)
    per_kind = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    lines = [f"requests: {len(outcomes)} in {minutes:.1f} min ({per_kind})",
             f"outcomes: {', '.join(f'{k} {v}' for k, v in sorted(by.items()))}",
             f"unexpected: {sum(v for k, v in by.items() if k not in EXPECTED)}"]
    for f in faults:
        lines.append(f"fault: engine {f.get('signal', 'SIGKILL')} at {f['t_s']:.0f} s: /ready 503 after {_f(f.get('detected_s'), '.1f')} s, "
                     f"ready again after {_f(f.get('ready_s'), '.1f')} s, "
                     f"first good answer after {_f(f.get('recovered_s'), '.1f')} s; {f['caught']} requests caught, "
                     f"ended within {_f(f.get('caught_end_max_s'), '.2f')} s ({f['caught_errors']} with an error); "
                     f"{f.get('batches_failed', 0)} batches with lines failed by it")
    lines.append("verdict: " + ("PASS" if not why else "FAIL: " + "; ".join(why)))
    return "\n".join(lines)


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=1, default=str))


def plot(path: Path, samples: list[dict], faults: list[dict]) -> bool:
    """A PNG of the figures over time, if matplotlib is installed (it is not a dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    panels = [
        ("resident memory (MiB)", [("server", lambda s: s["processes"].get("server", {}).get("rss_mib")),
                                   ("engine", lambda s: s["processes"].get("engine", {}).get("rss_mib")),
                                   ("all", lambda s: s["rss_mib"])]),
        ("open fds / threads", [("fds", lambda s: s["fds"]), ("threads", lambda s: s["threads"])]),
        ("TTFT (ms)", [("p50", lambda s: s["ttft_p50_ms"]), ("p99", lambda s: s["ttft_p99_ms"])]),
        ("ITL (ms)", [("p50", lambda s: s["itl_p50_ms"]), ("p99", lambda s: s["itl_p99_ms"])]),
        ("data dir / SQLite (MiB)", [("data dir", lambda s: s["data_mib"]), ("SQLite", lambda s: s["sqlite_mib"])]),
        ("per window", [("requests ok", lambda s: s["outcomes"].get("ok", 0)),
                        ("KV blocks idle", lambda s: s["kv_blocks_idle"]),
                        ("client loop lag max (ms)", lambda s: s["client_lag"]["max_ms"])]),
    ]
    for ax, (title, series) in zip(axes.flat, panels):
        for label, get in series:
            ys = [get(s) for s in samples]
            ax.plot(t, [float("nan") if y is None else y for y in ys], marker=".", label=label)
        for f in faults:
            ax.axvline(f["t_s"] / 60, color="red" if f.get("signal", "SIGKILL") == "SIGKILL" else "purple",
                       linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("minutes (red: engine SIGKILL, purple: SIGSTOP)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
