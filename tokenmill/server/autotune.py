"""The SLO autotuner: `serve --slo-ttft-ms X --slo-itl-ms Y`.

Operators state objectives, not batch sizes. Every `interval_s` the tuner looks at the
requests that arrived after its last change and have finished (their TTFT and mean inter-token time,
from the engine's own timestamps) and the engine's queue, and moves at most one knob
one bounded step:

  ITL over its objective      steps are too heavy: a smaller prefill budget per step
                              (chunks stall decode), then fewer running sequences;
                              with TTFT over too, the server is past capacity: the
                              admission queue is shortened so the excess is refused at
                              once (503) instead of waiting to miss anyway
  TTFT over, ITL fine         requests wait to start: more running sequences, then
                              shorter decode bursts (a burst holds back admission),
                              then a larger prefill budget
  both well under (< 60%)     throughput headroom: knobs go back toward the operator's
                              settings, one step at a time
  in between                  nothing (the dead band), except that an admission queue
                              cut earlier grows back while nobody waits and TTFT is
                              well under

Goodput is the rate of requests meeting both objectives. No knob exceeds what the
operator configured (those are upper bounds); a knob lowered for a violation is not
raised again for `hold_s`, and every decision needs `min_requests` fresh samples after
the last change, so the tuner does not oscillate. Every change is logged and counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.server.stats import Served

log = logging.getLogger("tokenmill.autotune")
RELAX = 0.6  # both percentiles under this share of their objectives: room to give back
ITL_ROOM = 0.8  # ITL under this share of its objective: a step may take more work
MAX_HOLD_S = 600.0


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float  # each request's mean time per output token after the first
    percentile: float = 90.0


@dataclass(frozen=True)
class Knobs:
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_steps: int
    max_waiting: int  # interactive requests that may wait before new ones get 503


@dataclass(frozen=True)
class AutotuneConfig:
    slo: SLO
    ceiling: Knobs  # the operator's settings: where tuning starts, and upper bounds
    interval_s: float = 2.0
    hold_s: float = 20.0


FLOORS = Knobs(max_num_seqs=2, max_num_batched_tokens=64, decode_steps=1, max_waiting=4)


@dataclass(frozen=True)
class Observation:
    requests: int  # finished since the last change (or in the window)
    ttft: float | None  # the SLO percentile
    itl: float | None
    waiting: int  # in the engine's queue now
    running: int
    oldest_wait_s: float = 0.0  # the longest-waiting request's wait so far


@dataclass(frozen=True)
class Change:
    knob: str
    old: int
    new: int
    reason: str


def observe(served: list[Served], slo: SLO, waiting: int, running: int, oldest_wait_s: float = 0.0) -> Observation:
    ttft = [r.ttft for r in served]
    itl = [r.tpot for r in served if r.tpot is not None]
    pct = slo.percentile
    return Observation(len(served), float(np.percentile(ttft, pct)) if ttft else None,
                       float(np.percentile(itl, pct)) if itl else None, waiting, running, oldest_wait_s)


def goodput(served: list[Served], slo: SLO, seconds: float) -> float:
    return sum(r.meets(slo.ttft_s, slo.itl_s) for r in served) / seconds if seconds > 0 else 0.0


def decide(k: Knobs, obs: Observation, slo: SLO, ceiling: Knobs, held: Callable[[str], bool],
           min_requests: int = 4) -> Change | None:
    """The next change (or None): pure, so it is tested on its own."""
    # someone in the queue has already waited past the TTFT objective: failing now, before
    # any of them finishes to say so
    starving = obs.waiting > 0 and obs.oldest_wait_s > slo.ttft_s
    if obs.requests < min_requests and not starving:
        return None
    itl_bad = obs.itl is not None and obs.itl > slo.itl_s
    ttft_bad = starving or (obs.ttft is not None and obs.ttft > slo.ttft_s)

    def lower(knob: str, factor: float, why: str) -> Change | None:
        old = getattr(k, knob)
        new = max(getattr(FLOORS, knob), int(old * factor))
        return Change(knob, old, new, why) if new < old else None

    def raise_(knob: str, factor: float, why: str) -> Change | None:
        old = getattr(k, knob)
        if held(knob):
            return None
        new = min(getattr(ceiling, knob), max(old + 1, math.ceil(old * factor)))
        return Change(knob, old, new, why) if new > old else None

    itl_txt = f"ITL p{slo.percentile:.0f} {_ms(obs.itl)} vs {_ms(slo.itl_s)}"
    ttft_txt = f"TTFT p{slo.percentile:.0f} {_ms(obs.ttft)} vs {_ms(slo.ttft_s)}" + (
        f", {obs.waiting} waiting" if obs.waiting else "")
    if itl_bad and ttft_bad:
        return (lower("max_waiting", 0.5, f"over capacity ({itl_txt}; {ttft_txt}): shed load sooner")
                or lower("max_num_batched_tokens", 0.5, itl_txt)
                or lower("max_num_seqs", 0.75, itl_txt))
    if itl_bad:
        return lower("max_num_batched_tokens", 0.5, itl_txt) or lower("max_num_seqs", 0.75, itl_txt)
    if ttft_bad:
        # more work per step only while ITL has room for it; at capacity the queue's wait is
        # the TTFT, and refusing the excess at once serves the admitted ones in time
        room = obs.itl is None or obs.itl < ITL_ROOM * slo.itl_s
        return ((raise_("max_num_seqs", 1.5, ttft_txt) if obs.waiting > 0 and room else None)
                or lower("decode_steps", 0.5, ttft_txt)
                or (raise_("max_num_batched_tokens", 2.0, ttft_txt) if room else None)
                or (lower("max_waiting", 0.5, f"at capacity ({ttft_txt}): shed load sooner")
                    if obs.waiting > 0 else None))
    relaxed = (obs.ttft is None or obs.ttft < RELAX * slo.ttft_s) and (obs.itl is None or obs.itl < RELAX * slo.itl_s)
    if relaxed:
        why = f"headroom ({ttft_txt}; {itl_txt})"
        return (raise_("max_num_batched_tokens", 2.0, why) or raise_("decode_steps", 2.0, why)
                or raise_("max_num_seqs", 1.5, why) or raise_("max_waiting", 2.0, why))
    if obs.waiting == 0 and (obs.ttft is None or obs.ttft < RELAX * slo.ttft_s):
        # the queue bound costs no step any time: with nobody waiting and TTFT well in, a
        # short queue would only refuse the next burst
        return raise_("max_waiting", 2.0, f"queue empty ({ttft_txt})")
    return None


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


class Autotuner:
    """Runs `decide` on the event loop and applies its changes to the engine and gate."""

    def __init__(self, slo: SLO, engine: Any, gate: Any, stats: Any, metrics: Any, ceiling: Knobs,
                 interval_s: float = 2.0, window_s: float = 20.0, hold_s: float = 20.0,
                 clock: Callable[[], float] = time.time):
        self.slo = slo
        self.engine = engine
        self.gate = gate
        self.stats = stats
        self.metrics = metrics
        self.ceiling = ceiling
        self.knobs = ceiling  # start from the operator's settings
        self.interval_s = interval_s
        self.window_s = window_s
        self.hold_s = hold_s
        self.clock = clock
        self.last_change = clock()
        self.lowered_at: dict[str, float] = {}
        self.last_dir: dict[str, str] = {}
        self.reversals: dict[str, int] = {}  # a knob lowered again after a raise: held twice as long
        self.changes: list[tuple[float, Change]] = []  # the recent ones, for /v1/stats
        self._task: asyncio.Task | None = None
        for name in ("max_num_seqs", "max_num_batched_tokens", "decode_steps", "max_waiting"):
            metrics.autotune_knob.labels(knob=name).set(getattr(self.knobs, name))

    def held(self, knob: str) -> bool:
        """A knob lowered for a violation is not raised again for hold_s, doubled each time
        a raise of it had to be taken back: a load that sits on the edge does not make it
        flap. (Lowering step after step in one episode is a descent, not a reversal.)"""
        hold = min(MAX_HOLD_S, self.hold_s * 2 ** self.reversals.get(knob, 0))
        return self.clock() - self.lowered_at.get(knob, -math.inf) < hold

    def step(self) -> Change | None:
        now = self.clock()
        # only requests that arrived after the last change: the ones it could have affected
        since = max(self.last_change, now - self.window_s)
        served = self.stats.served_since(since, arrived_since=since)
        s = self.engine.stats()
        obs = observe(served, self.slo, s.num_waiting_interactive, s.num_running, s.oldest_waiting_s)
        change = decide(self.knobs, obs, self.slo, self.ceiling, self.held)
        if change is not None:
            self.apply(change, now)
        return change

    def apply(self, change: Change, now: float) -> None:
        self.knobs = dataclasses.replace(self.knobs, **{change.knob: change.new})
        if change.knob == "max_waiting":
            self.gate.admission = dataclasses.replace(self.gate.admission, max_waiting_interactive=change.new)
        else:
            self.engine.tune(**{change.knob: change.new})
        direction = "down" if change.new < change.old else "up"
        if direction == "down":
            self.lowered_at[change.knob] = now
            if self.last_dir.get(change.knob) == "up":
                self.reversals[change.knob] = self.reversals.get(change.knob, 0) + 1
        self.last_dir[change.knob] = direction
        self.last_change = now
        self.changes = (self.changes + [(now, change)])[-50:]
        self.metrics.autotune_changes.labels(knob=change.knob, direction=direction).inc()
        self.metrics.autotune_knob.labels(knob=change.knob).set(change.new)
        log.info("autotune: %s %d -> %d (%s)", change.knob, change.old, change.new, change.reason)

    def status(self) -> dict[str, Any]:
        now = self.clock()
        served = self.stats.served_since(now - 60.0)
        return {"slo": {"ttft_ms": self.slo.ttft_s * 1000, "itl_ms": self.slo.itl_s * 1000,
                        "percentile": self.slo.percentile},
                "knobs": dataclasses.asdict(self.knobs), "ceiling": dataclasses.asdict(self.ceiling),
                "goodput_rps_1m": goodput(served, self.slo, 60.0),
                "met_1m": sum(r.meets(self.slo.ttft_s, self.slo.itl_s) for r in served), "finished_1m": len(served),
                "changes": [{"time": t, **dataclasses.asdict(c)} for t, c in self.changes[-10:]]}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if self.engine.running:
                    self.step()
            except Exception:  # a bad step must not end the tuning loop
                log.exception("autotune step failed")

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
