"""`--faults`: the engine process SIGKILLed, and later SIGSTOPped, while the soak runs. The
server notices a death at once, a stop through its hang watchdog (`--engine-hang-timeout`),
fails what was in flight, and starts a new engine (tokenmill/engine/process_engine.py);
measured here: when /ready says the engine is gone and when it answers again, when the
first good (reference-checked) answer comes back, and how fast the requests caught in it
ended."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx

from benchmarks.soak.probe import engine_pid
from benchmarks.soak.report import FAULT_END_BOUND_S, FAULT_RECOVERY_BOUND_S
from benchmarks.soak.traffic import ENGINE_FAULT_CODES, answer_of, error_code

PROBE_EVERY_S = 0.2
# Errors from the engine's death are expected from the kill until this long after the first
# good answer (requests admitted just before the new engine was up).
FAULT_GRACE_S = 2.0


def end_bound_s(sig: str, hang_timeout_s: float) -> float:
    """How soon a request caught in the fault must end: a dead engine is seen at once, a
    stopped one only when the watchdog's bound has passed."""
    return FAULT_END_BOUND_S + (hang_timeout_s if sig == "SIGSTOP" else 0.0)


async def kill_engine(http: httpx.AsyncClient, pgid: int, t0: float, key: str,
                      probe: tuple[str, dict, list[str]], sig: str = "SIGKILL",
                      hang_timeout_s: float = 0.0) -> dict[str, Any]:
    """Send the engine `sig` now (SIGKILL: it dies; SIGSTOP: it hangs); return the fault's
    record once a good answer came back (or the bound passed)."""
    pid = engine_pid(pgid)
    bound = end_bound_s(sig, hang_timeout_s)
    if pid is None:
        return {"t_s": time.monotonic() - t0, "kill_at": time.monotonic(), "pid": None, "ready_s": None,
                "signal": sig, "end_bound_s": bound, "recovered_s": None, "note": "no engine process found"}
    killed = time.monotonic()
    os.kill(pid, getattr(signal, sig))
    f: dict[str, Any] = {"t_s": killed - t0, "kill_at": killed, "pid": pid, "signal": sig, "end_bound_s": bound,
                         "ready_s": None, "recovered_s": None, "detected_s": None, "probe_log": [],
                         "probe_mismatch": None}
    path, body, want = probe
    headers = {"Authorization": f"Bearer {key}"}
    sent = 0.0
    while time.monotonic() - killed < FAULT_RECOVERY_BOUND_S + 10:
        try:
            if f["ready_s"] is None:
                ready = (await http.get("/ready", timeout=5)).status_code == 200
                if not ready and f["detected_s"] is None:  # the server saw the engine die
                    f["detected_s"] = time.monotonic() - killed
                elif ready and f["detected_s"] is not None:
                    f["ready_s"] = time.monotonic() - killed
            sent = time.monotonic() - killed
            r = await http.post(path, json=body, headers=headers, timeout=30)
            if r.status_code == 200:
                got = answer_of(path, r.json()["choices"])
                if got == want:
                    f["recovered_s"] = time.monotonic() - killed
                    f["probe_log"].append([round(sent, 2), round(f["recovered_s"], 2), "ok"])
                    break
                f["probe_mismatch"] = f"{got!r} against the reference {want!r}"
            else:
                code = error_code(r.json())
                if code in ENGINE_FAULT_CODES and f["detected_s"] is None:  # the server said so first
                    f["detected_s"] = time.monotonic() - killed
                f["probe_log"].append([round(sent, 2), round(time.monotonic() - killed, 2), f"{r.status_code} {code}"])
        except (httpx.HTTPError, ValueError) as exc:
            f["probe_log"].append([round(sent, 2), round(time.monotonic() - killed, 2), type(exc).__name__])
        await asyncio.sleep(PROBE_EVERY_S)
    f["new_pid"] = engine_pid(pgid)
    return f


def settle(faults: list[dict], outcomes: list[Any]) -> None:
    """Mark each fault's caught requests (in flight at the kill) and relabel an engine
    error that no fault explains: it is then a failure."""
    windows = []
    for f in faults:
        k = f["kill_at"]
        end = k + (f["recovered_s"] if f["recovered_s"] is not None else FAULT_RECOVERY_BOUND_S) + FAULT_GRACE_S
        windows.append((k, end))
        caught = [o for o in outcomes if o.kind != "batch" and o.start < k < o.end]
        f["caught"] = len(caught)
        f["caught_errors"] = sum(o.status == "engine_fault" for o in caught)
        f["caught_end_max_s"] = max((o.end - k for o in caught), default=None)
    for f in faults:
        k = f["kill_at"]
        f["batches_failed"] = sum(o.kind == "batch" and o.status == "engine_fault" and o.start < k < o.end
                                  for o in outcomes)
    for o in outcomes:
        # a live request must end in the window; a batch (minutes long) must overlap it
        explained = any((a <= o.end <= b) if o.kind != "batch" else (o.start <= b and o.end >= a)
                        for a, b in windows)
        if o.status == "engine_fault" and not explained:
            o.status = "engine_fault_unexplained"


def fault_plan(rng: Any, duration_s: float, warm_s: float) -> list[tuple[float, str]]:
    """When (seconds into the traffic) to kill the engine, and later to stop it: after the
    warm-up, apart, early enough that recovery and later traffic are seen."""
    plan = []
    for sig, lo, hi in (("SIGKILL", 0.3, 0.45), ("SIGSTOP", 0.55, 0.7)):
        lo, hi = max(warm_s, lo * duration_s), hi * duration_s
        if hi > lo:
            plan.append((rng.uniform(lo, hi), sig))
    return plan
