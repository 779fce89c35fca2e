"""Spend-rate alarms: spend over a trailing window, per tenant and per server.

A budget (budget.py) caps a fixed period's total; an alarm watches the rate. A
`SpendAlarm(limit_usd, window_s, block)` is raised when the spend recorded in the
trailing `window_s` seconds exceeds `limit_usd` (a rate of `limit_usd / window_s`), and
clears when that spend falls back to the limit or below. A runaway agent loop or a
leaked key is caught within one window, however much of a day's budget is left. With
`block`, the server refuses new requests of the alarm's scope while it is raised, until
enough spend has left the window.

The window is kept as `SLOTS` buckets of `window_s / SLOTS` seconds each, so memory is
bounded per scope and the trailing sum is exact at bucket granularity: spend leaves the
window up to one bucket late, never early (an alarm may stay raised up to
`window_s / SLOTS` longer than an exact window would keep it, never shorter).

As with budgets, cost is known when a request ends: concurrent requests admitted before
the alarm rose can still add to the window. In-process and thread-safe (one lock); one
`AlarmBoard` per server; the clock is injected so tests move time by hand.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

from tokenmill.cost.values import to_decimal

SLOTS = 60


@dataclass(frozen=True)
class SpendAlarm:
    """Raised while more than `limit_usd` was spent in the trailing `window_s` seconds."""

    limit_usd: Decimal
    window_s: float = 3600.0
    block: bool = False  # refuse new requests while raised

    def __post_init__(self) -> None:
        object.__setattr__(self, "limit_usd", to_decimal(self.limit_usd))
        if not self.limit_usd >= 0:
            raise ValueError(f"alarm limit_usd must be >= 0, got {self.limit_usd}")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"alarm window_s must be a positive number of seconds, got {self.window_s}")

    @property
    def slot_s(self) -> float:
        return self.window_s / SLOTS


@dataclass(frozen=True)
class AlarmState:
    """One scope's alarm as of an observation."""

    scope: str
    alarm: SpendAlarm
    spent_usd: Decimal  # in the trailing window
    raised: bool
    change: str | None = None  # "raised" or "cleared" when this observation changed it
    retry_after_s: float = 0.0  # while raised: until the window's spend is back to the limit

    def message(self) -> str:
        return (f"spend alarm for {self.scope}: ${self.spent_usd:f} spent in the last {self.alarm.window_s:g}s "
                f"exceeds ${self.alarm.limit_usd:f}")


@dataclass
class _Window:
    alarm: SpendAlarm
    buckets: dict[int, Decimal] = field(default_factory=dict)  # bucket index -> spend
    raised: bool = False


class AlarmBoard:
    """Trailing-window spend and alarm state per scope (e.g. "server", "tenant:acme")."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def observe(self, scope: str, alarm: SpendAlarm | None, usd: Decimal | float | int | str = 0) -> AlarmState | None:
        """Add `usd` to the scope's window (0 only looks) and return its alarm state;
        None when the scope has no alarm (its window, if any, is dropped)."""
        amount = to_decimal(usd)
        if amount < 0:
            raise ValueError(f"cannot record negative spend {amount} for {scope}")
        with self._lock:
            if alarm is None:
                self._windows.pop(scope, None)
                return None
            now = self._clock()
            w = self._windows.get(scope)
            if w is None or w.alarm != alarm:  # new, or its alarm was changed: start afresh
                w = self._windows[scope] = _Window(alarm)
            index = math.floor(now / alarm.slot_s)
            # Buckets index - SLOTS .. index: SLOTS + 1 of them, so that a bucket leaves only
            # once all of its spend is older than the window (late, never early).
            for old in [b for b in w.buckets if b < index - SLOTS]:
                del w.buckets[old]
            if amount:
                w.buckets[index] = w.buckets.get(index, Decimal(0)) + amount
            spent = sum(w.buckets.values(), Decimal(0))
            raised = spent > alarm.limit_usd
            change = None if raised == w.raised else ("raised" if raised else "cleared")
            w.raised = raised
            retry = self._retry_after(w, spent, now) if raised else 0.0
        return AlarmState(scope, alarm, spent, raised, change, retry)

    @staticmethod
    def _retry_after(w: _Window, spent: Decimal, now: float) -> float:
        """Seconds until the oldest buckets leave the window and spend is <= the limit."""
        slot = w.alarm.slot_s
        for index in sorted(w.buckets):
            spent -= w.buckets[index]
            if spent <= w.alarm.limit_usd:
                return max(0.0, (index + SLOTS + 1) * slot - now)
        return w.alarm.window_s  # unreachable: removing every bucket leaves 0 <= limit
