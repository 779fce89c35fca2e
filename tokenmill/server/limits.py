"""Rate limiting primitives: token buckets over an injectable clock, and OpenAI's
x-ratelimit-* header values.

A bucket of capacity C refills at C per window (a minute for RPM and TPM). Taking
more than is there is refused with the wait until enough has refilled; a reservation
can be partly given back later (output tokens reserved at admission from max_tokens,
settled at finish).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    retry_after_s: float
    message: str
    code: str


def request_burst(per_minute: int) -> int:
    """How many requests may arrive back to back under a per-minute limit: five seconds'
    worth, at least 3 (never more than the limit). Like OpenAI's limits "enforced over
    shorter periods", this holds a flood near its rate instead of letting a large slice
    of the minute's quota land on the engine at once."""
    return min(per_minute, max(3, math.ceil(per_minute / 12)))


class TokenBucket:
    def __init__(self, capacity: int, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 burst: int | None = None):
        """`capacity` per `window_s`, refilled continuously; at most `burst` (default:
        capacity) can be taken at once."""
        if capacity < 1:
            raise ValueError("a rate limit must be at least 1 per window")
        self.limit = capacity
        self.capacity = burst or capacity
        self.rate = capacity / window_s  # per second
        self.clock = clock
        self._level = float(self.capacity)
        self._t = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self._level = min(self.capacity, self._level + (now - self._t) * self.rate)
        self._t = now

    def try_take(self, amount: float) -> float | None:
        """Take `amount`; None on success, else seconds until it would succeed
        (math.inf if it never can: more than the whole capacity)."""
        with self._lock:
            self._refill()
            if amount > self.capacity:
                return math.inf
            if self._level >= amount:
                self._level -= amount
                return None
            return (amount - self._level) / self.rate

    def give_back(self, amount: float) -> None:
        with self._lock:
            self._refill()
            self._level = min(self.capacity, self._level + amount)

    def take_unchecked(self, amount: float) -> None:
        """Charge usage beyond a reservation (the level may go negative: future requests wait)."""
        with self._lock:
            self._refill()
            self._level -= amount

    @property
    def remaining(self) -> int:
        with self._lock:
            self._refill()
            return max(0, int(self._level))

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        with self._lock:
            self._refill()
            return max(0.0, (self.capacity - self._level) / self.rate)


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '20ms', '1h2m3s'."""
    if seconds < 1:
        return f"{max(0, int(round(seconds * 1000)))}ms"
    seconds = round(seconds, 3)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    s_txt = f"{s:.3f}".rstrip("0").rstrip(".") + "s"
    if h:
        return f"{int(h)}h{int(m)}m{s_txt}"
    if m:
        return f"{int(m)}m{s_txt}"
    return s_txt


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
