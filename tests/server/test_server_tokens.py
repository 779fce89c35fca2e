"""The token rate-limit headers of a key without a TPM limit: the server's own capacity
and use per minute (ServerTokens), from the engine's token counter."""

from __future__ import annotations

from tokenmill.engine.api import EngineDeadError
from tokenmill.server.limits import ServerTokens


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(floor: int = 1000):
    clock, counter = Clock(), {"n": 0}
    return ServerTokens(lambda: counter["n"], lambda: floor, clock), clock, counter


def figures(st: ServerTokens) -> tuple[int, int, str]:
    h = st.headers()
    return int(h["x-ratelimit-limit-tokens"]), int(h["x-ratelimit-remaining-tokens"]), h["x-ratelimit-reset-tokens"]


def test_an_idle_server_reports_its_kv_cache_as_the_limit():
    st, clock, _ = make()
    assert figures(st) == (1000, 1000, "0ms")
    clock.t += 30
    assert figures(st) == (1000, 1000, "0ms")


def test_use_in_the_last_minute_lowers_remaining_and_the_best_minute_raises_the_limit():
    st, clock, counter = make()
    figures(st)
    clock.t += 20
    counter["n"] = 600
    assert figures(st) == (1000, 400, "36s")  # 600 tokens at 1000 a minute
    clock.t += 20
    counter["n"] = 3000  # a busy minute: more than the cache, so that is the capacity now
    assert figures(st) == (3000, 0, "1m0s")
    clock.t += 60
    assert figures(st)[:2] == (3000, 3000)  # nothing in the last minute; the best minute stays
    clock.t += 60
    counter["n"] = 3300
    assert figures(st) == (3000, 2700, "6s")


def test_a_long_gap_between_samples_counts_its_rate_not_its_total():
    st, clock, counter = make()
    figures(st)
    clock.t += 300
    counter["n"] = 5000  # over five minutes: 1000 a minute
    assert figures(st) == (1000, 0, "1m0s")


def test_tokens_before_the_first_look_count():
    st, clock, counter = make()
    clock.t += 10
    counter["n"] = 250  # the first request, answered before anyone asked for headers
    assert figures(st) == (1000, 750, "15s")


def test_a_new_engine_restarts_the_count():
    st, clock, counter = make()
    counter["n"] = 900
    figures(st)
    clock.t += 5
    counter["n"] = 100  # the engine was replaced: its counters start again
    assert figures(st) == (1000, 900, "6s")
    clock.t += 30
    counter["n"] = 400
    assert figures(st) == (1000, 600, "24s")


def test_nothing_before_the_engine_has_started():
    def not_started() -> int:
        raise EngineDeadError("the engine has not started")

    assert ServerTokens(lambda: 0, not_started).headers() == {}
