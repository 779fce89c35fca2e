"""Rate limiting primitives: token buckets over an injectable clock, and OpenAI's
x-ratelimit-* header values.

A bucket of capacity C refills at C per window (a minute for RPM and TPM). Taking
more than is there is refused with the wait until enough has refilled; a reservation
can be partly given back later (output tokens reserved at admission from max_tokens,
settled at finish).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.api import EngineDeadError


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


class ServerTokens:
    """The server's own token figures per minute, for the token rate-limit headers of a key
    with no TPM limit (OpenAI always sends them; the limit is then the server's capacity):
    - limit: the most tokens (prompt computed + generated) the engine has processed in a
      minute, and never less than its KV cache holds, which it takes in and drains well
      within a minute;
    - remaining: that less what it processed in the last minute (0 when it runs at its best);
    - reset: the time it takes at that rate to process what the last minute used.
    Sampled from the engine's counters when headers are asked for."""

    WINDOW_S = 60.0

    def __init__(self, processed: Callable[[], int], floor: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic):
        self.processed = processed  # tokens processed since start (a counter)
        self.floor = floor  # the KV cache's tokens (raises until the engine has started)
        self.clock = clock
        self.peak = 0
        self._samples: deque[tuple[float, int]] = deque([(clock(), 0)])  # the counters start at 0
        self._last = 0
        self._lock = threading.Lock()

    def _used(self) -> int:
        """Tokens processed in the last minute (the rate over a longer gap between samples)."""
        now, total = self.clock(), self.processed()
        s = self._samples
        if total < self._last:  # the counters started again (a new engine): from 0, lately
            s.clear()
            s.append((now, 0))
        self._last = total
        if now - s[-1][0] >= 0.25:
            s.append((now, total))
        while len(s) > 1 and now - s[1][0] >= self.WINDOW_S:  # keep one sample from before the window
            s.popleft()
        t0, n0 = s[0]
        span = now - t0
        used = total - n0 if span <= self.WINDOW_S else int((total - n0) * self.WINDOW_S / span)
        self.peak = max(self.peak, used)
        return used

    def headers(self) -> dict[str, str]:
        try:
            floor = self.floor()
        except EngineDeadError:  # the engine has not started: nothing to say yet
            return {}
        with self._lock:
            used = self._used()
            limit = max(self.peak, floor, 1)
        return {"x-ratelimit-limit-tokens": str(limit),
                "x-ratelimit-remaining-tokens": str(max(0, limit - used)),
                "x-ratelimit-reset-tokens": format_duration(used * self.WINDOW_S / limit)}


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


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object) -> float:
    """How long a model stays loaded once idle, as Ollama's keep_alive: seconds as a
    number, or a duration string ("5m", "1h30m", "90s", "250ms", "-1"); 0 unloads it when
    its last request ends, any negative value keeps it (returned as math.inf). Raises
    ValueError naming what it accepts."""
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a number of seconds or a duration such as '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
            parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)(ms|h|m|s))+", body) and re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)",
                                                                                        body)
            if not parts:
                raise ValueError(f"keep_alive must be a number of seconds or a duration such as '5m', "
                                 f"'1h30m' or '-1', got {value!r}") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError("keep_alive must be a number of seconds or a duration such as '5m'")
    if not math.isfinite(seconds) and seconds > 0:
        raise ValueError("keep_alive must be finite (a negative value keeps the model loaded)")
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number")
    return math.inf if seconds < 0 else seconds
