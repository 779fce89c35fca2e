"""The SLO autotuner: `serve --slo-ttft-ms X --slo-itl-ms Y`.

Operators state objectives, not batch sizes. Every `interval_s` the tuner reads what
the server already measures and may change two knobs: one that shapes the engine's
steps (max running sequences, prefill tokens per step, decode burst length) and the
admission queue's bound. Its signals:

- ITL: the objective's percentile of each request's mean time per output token (TPOT)
  over requests that arrived after the last change and have finished; until there are
  enough of those, the live per-sequence time per token from the engine's counters
  over the last interval (prefill stalls included, as a client sees them);
- TTFT: the percentile over the same fresh requests, and the wait of the request that
  has waited longest in the queue now (a request already past the objective is a
  miss before it finishes to say so);
- the finish rate (requests per second over the last window).

Rules:

  ITL over           fewer running sequences, scaled by objective / measured (at most
                     halved per change), from what is running, not from the bound; never
                     again while more than the new bound still run (they are draining);
                     at the floor, a smaller prefill budget per step
  TTFT over          with ITL room (< 70%) and a queue: more running sequences (never
                     up to a count seen over the ITL objective recently); without
                     room the server is at capacity: the queue bound goes to what the
                     finish rate can start within the objective (Little's law; at most
                     a quarter per change), so the excess is refused at once (503)
                     instead of waiting to miss
  both well under    (< 60%) headroom: step knobs go back toward the operator's settings
  nobody waiting     the queue bound grows back (it costs no step), with TTFT well under

After a cut, requests admitted under the old bound still run: until they drain, what is
measured belongs to the old setting, so the fresh window starts only once they have, and
nothing seen meanwhile is remembered as "over at this count". A count remembered so is
forgotten once that many run well within the ITL objective.

Goodput is the rate of requests meeting both objectives. No knob exceeds what the
operator configured (those are upper bounds) or goes below FLOORS; a knob lowered is
not raised again for `hold_s`, doubled each time a raise had to be taken back, so a
load on the edge does not make it flap. Every change is logged and counted.
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
ITL_ROOM = 0.7  # ITL under this share of its objective: a step may take more work
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
    requests: int  # fresh: arrived after the last change, and finished
    ttft: float | None  # the SLO percentile over the fresh requests
    itl: float | None  # likewise (TPOT), or the live per-sequence time per token
    waiting: int  # in the engine's queue now
    running: int
    oldest_wait_s: float = 0.0  # the longest-waiting request's wait so far
    finish_rate: float = 0.0  # requests finished per second, recent window


@dataclass(frozen=True)
class Change:
    knob: str
    old: int
    new: int
    reason: str


def observe(served: list[Served], slo: SLO, waiting: int, running: int, oldest_wait_s: float = 0.0,
            live_itl: float | None = None, finish_rate: float = 0.0, min_requests: int = 4) -> Observation:
    ttft = [r.ttft for r in served]
    itl = [r.tpot for r in served if r.tpot is not None]
    pct = slo.percentile
    fresh = len(served) >= min_requests
    return Observation(len(served), float(np.percentile(ttft, pct)) if ttft and fresh else None,
                       float(np.percentile(itl, pct)) if itl and fresh else live_itl, waiting, running,
                       oldest_wait_s, finish_rate)


def goodput(served: list[Served], slo: SLO, seconds: float) -> float:
    return sum(r.meets(slo.ttft_s, slo.itl_s) for r in served) / seconds if seconds > 0 else 0.0


def decide(k: Knobs, obs: Observation, slo: SLO, ceiling: Knobs, held: Callable[[str], bool],
           itl_over_at: int | None = None) -> list[Change]:
    """The changes to make now (at most one step knob and the queue bound): pure, so it is
    tested on its own. `itl_over_at`: a recent running count whose ITL was over the
    objective; more sequences are not admitted up to it again for TTFT's sake."""
    late = obs.waiting > 0 and obs.oldest_wait_s > slo.ttft_s
    itl_bad = obs.itl is not None and obs.itl > slo.itl_s
    ttft_bad = late or (obs.ttft is not None and obs.ttft > slo.ttft_s)
    room = obs.itl is None or obs.itl < ITL_ROOM * slo.itl_s

    def lower(knob: str, new: int, why: str) -> Change | None:
        old = getattr(k, knob)
        new = max(getattr(FLOORS, knob), int(new))
        return Change(knob, old, new, why) if new < old else None

    def raise_(knob: str, factor: float, why: str, below: int | None = None) -> Change | None:
        old = getattr(k, knob)
        if held(knob):
            return None
        new = min(getattr(ceiling, knob), max(old + 1, math.ceil(old * factor)))
        if below is not None:
            new = min(new, below - 1)
        return Change(knob, old, new, why) if new > old else None

    itl_txt = f"ITL p{slo.percentile:.0f} {_ms(obs.itl)} vs {_ms(slo.itl_s)}"
    ttft_txt = f"TTFT p{slo.percentile:.0f} {_ms(obs.ttft)} vs {_ms(slo.ttft_s)}" + (
        f", {obs.waiting} waiting, oldest {_ms(obs.oldest_wait_s)}" if obs.waiting else "")

    step: Change | None = None
    if itl_bad:
        if obs.running <= k.max_num_seqs:  # above it, requests admitted earlier are still draining
            scale = min(0.85, max(0.5, 0.9 * slo.itl_s / obs.itl))
            step = lower("max_num_seqs", min(k.max_num_seqs, obs.running) * scale, itl_txt)
        if step is None and k.max_num_seqs <= FLOORS.max_num_seqs:
            step = lower("max_num_batched_tokens", k.max_num_batched_tokens // 2, itl_txt)
    elif ttft_bad:
        if obs.waiting > 0 and room:
            step = raise_("max_num_seqs", 1.25, ttft_txt, itl_over_at)
        # (shorter decode bursts are no cure: a burst delays a waiting prefill by a few
        # steps, tens of ms, while cutting it costs the throughput a queue needs drained;
        # measured on the step load, bursts of 1 halved the heavy phase's goodput)
    elif ((obs.ttft is None or obs.ttft < RELAX * slo.ttft_s) and obs.oldest_wait_s < RELAX * slo.ttft_s
          and obs.itl is not None and obs.itl < RELAX * slo.itl_s):
        why = f"headroom ({ttft_txt}; {itl_txt})"
        step = (raise_("max_num_seqs", 1.5, why, itl_over_at) or raise_("max_num_batched_tokens", 2.0, why)
                or raise_("decode_steps", 2.0, why))

    queue: Change | None = None
    if ttft_bad and obs.waiting > 0 and not (room and step is not None and step.new > step.old):
        # at capacity: keep only the queue the finish rate can start within the objective
        fits = math.floor(obs.finish_rate * slo.ttft_s)
        queue = lower("max_waiting", max(fits, k.max_waiting // 4),
                      f"at capacity ({ttft_txt}; {obs.finish_rate:.1f} req/s finishing): shed load sooner")
    elif obs.waiting == 0 and not itl_bad and (obs.ttft is None or obs.ttft < RELAX * slo.ttft_s):
        # the bound costs no step: with nobody waiting and TTFT well in, a short queue would
        # only refuse the next burst
        queue = raise_("max_waiting", 2.0, f"queue empty ({ttft_txt})")
    return [c for c in (step, queue) if c is not None]


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
        self.started = self.last_change
        self._last: tuple[float, int, int] | None = None  # (time, generation tokens, running) at the last step
        self._itl_over: tuple[float, int] | None = None  # (when, fewest running) ITL was last over its objective
        self.lowered_at: dict[str, float] = {}
        self.last_dir: dict[str, str] = {}
        self.reversals: dict[str, int] = {}  # a knob lowered again after a raise: held twice as long
        self.changes: list[tuple[float, Change]] = []  # the recent ones, for /v1/stats
        self._task: asyncio.Task | None = None
        for name in ("max_num_seqs", "max_num_batched_tokens", "decode_steps", "max_waiting"):
            metrics.autotune_knob.labels(knob=name).set(getattr(self.knobs, name))

    def _memory_s(self) -> float:
        """How long a running count seen over the ITL objective bounds raises for TTFT."""
        return 3 * min(MAX_HOLD_S, self.hold_s * 2 ** self.reversals.get("max_num_seqs", 0))

    def held(self, knob: str) -> bool:
        """A knob lowered for a violation is not raised again for hold_s, doubled each time
        a raise of it had to be taken back: a load that sits on the edge does not make it
        flap. (Lowering step after step in one episode is a descent, not a reversal.)"""
        hold = min(MAX_HOLD_S, self.hold_s * 2 ** self.reversals.get(knob, 0))
        return self.clock() - self.lowered_at.get(knob, -math.inf) < hold

    def step(self) -> list[Change]:
        now = self.clock()
        s = self.engine.stats()
        # After a cut, requests admitted under the old bound still run: what anyone measures
        # until they drain is the old setting's, so the fresh window starts when they have.
        draining = s.num_running > self.knobs.max_num_seqs
        if draining:
            self.last_change = now
        # only requests that arrived after the last change: the ones it could have affected
        since = max(self.last_change, now - self.window_s)
        served = self.stats.served_since(since, arrived_since=since)
        recent = self.stats.served_since(now - self.window_s)
        live_itl = None
        if self._last is not None:
            t0, gen0, run0 = self._last
            tokens = s.generation_tokens - gen0
            running = (run0 + s.num_running) / 2
            if tokens > 0 and running >= 1:
                live_itl = (now - t0) * running / tokens  # seconds per token, per running sequence
        self._last = (now, s.generation_tokens, s.num_running)
        span = min(self.window_s, max(now - self.started, 1e-3))
        obs = observe(served, self.slo, s.num_waiting_interactive, s.num_running, s.oldest_waiting_s, live_itl,
                      len(recent) / span)
        if not draining and obs.itl is not None and obs.itl > self.slo.itl_s and s.num_running > 0:
            self._itl_over = (now, s.num_running if self._itl_over is None or now - self._itl_over[0] > self._memory_s()
                              else min(s.num_running, self._itl_over[1]))
        if self._itl_over is not None and (now - self._itl_over[0] > self._memory_s() or (
                not draining and obs.itl is not None and obs.itl < ITL_ROOM * self.slo.itl_s
                and s.num_running >= self._itl_over[1])):
            self._itl_over = None  # forgotten, or contradicted: that many run well within the objective now
        changes = decide(self.knobs, obs, self.slo, self.ceiling, self.held,
                         self._itl_over[1] if self._itl_over else None)
        for change in changes:
            self.apply(change, now)
        return changes

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
                else:
                    self._last = None  # a restarted engine's counters start again
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
