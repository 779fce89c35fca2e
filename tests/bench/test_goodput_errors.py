"""Goodput counts only requests within the objectives; failures are counted by kind and
never stop a run; runs respect their request-count and duration bounds."""

from __future__ import annotations

import pytest

from tests.bench.fake_server import Behavior, FakeOpenAIServer
from tests.bench.helpers import bench_once
from tokenmill.bench.runner import RunSpec
from tokenmill.bench.stats import Slo
from tokenmill.bench.workload import poisson_arrivals

FAST = Behavior(ttft_s=0.05, itl_s=0.02)


def mixed_plan(i: int, body: dict) -> Behavior:
    """Arrival 0 is the warm-up; then a repeating pattern of four request types."""
    if i == 0:
        return FAST
    return [
        Behavior(ttft_s=0.30, itl_s=0.02),                         # TTFT too slow
        Behavior(ttft_s=0.05, itl_s=0.08),                         # every gap too slow
        Behavior(ttft_s=0.05, itl_s=0.02, stall_at=5, stall_s=0.06),  # one 80 ms gap, mean 27 ms
        FAST,                                                      # good
    ][(i - 1) % 4]


def test_goodput_counts_only_requests_meeting_ttft_and_mean_itl():
    with FakeOpenAIServer(mixed_plan) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=8, concurrency=1)], output_len=10,
                         slo=Slo(ttft_ms=150, itl_ms=50))
    [run] = res["runs"]
    assert run["num_ok"] == 8
    # good: the fast ones and the ones with a single stall (mean ITL is the statistic)
    assert run["num_good"] == 4
    assert run["goodput_rps"] == pytest.approx(4 / run["duration_s"])
    assert run["requests_per_s"] == pytest.approx(8 / run["duration_s"])
    assert run["slo"] == {"ttft_ms": 150, "itl_ms": 50, "itl_statistic": "mean"}
    stalled = [r for r in run["requests"] if r["itl_ms"] and max(r["itl_ms"]) > 70]
    assert len(stalled) == 4  # 2 slow-ITL + 2 stalled; only the stalled ones are good


def test_goodput_with_only_a_ttft_objective():
    with FakeOpenAIServer(mixed_plan) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=8, concurrency=1)], output_len=10,
                         slo=Slo(ttft_ms=150))
    assert res["runs"][0]["num_good"] == 6


def error_plan(i: int, body: dict) -> Behavior:
    if i == 0:
        return FAST
    kinds = ["http_500", "http_429", "drop_mid_stream", "drop_before_response", "stream_error", "truncate",
             "ok", "eos_early"]
    return Behavior(ttft_s=0.02, itl_s=0.01, kind=kinds[(i - 1) % len(kinds)])  # type: ignore[arg-type]


def test_errors_are_counted_by_kind_and_the_run_completes():
    with FakeOpenAIServer(error_plan) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=16, concurrency=3)], output_len=6,
                         slo=Slo(ttft_ms=1000, itl_ms=1000))
    [run] = res["runs"]
    assert run["num_requests"] == 16
    assert run["num_ok"] == 4 and run["num_errors"] == 12
    assert run["errors_by_kind"] == {"connection_dropped": 4, "http_429": 2, "http_500": 2,
                                     "stream_error": 2, "truncated_stream": 2}
    assert run["num_good"] == 4  # a failed request is never good
    # an answer that stopped at EOS is a success, but flagged as shorter than asked
    assert run["finish_reasons"] == {"length": 2, "stop": 2} and run["num_short_outputs"] == 2
    # only successful requests feed the token totals and latency summaries
    assert run["output_tokens_total"] == 2 * 6 + 2 * 3
    assert all(r["error"] for r in run["requests"] if not r["ok"])


def test_timeouts_and_refused_connections_are_errors_too():
    slow = lambda i, body: Behavior(ttft_s=0.01 if i == 0 else 2.0, itl_s=0.01)  # noqa: E731
    with FakeOpenAIServer(slow) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=2, concurrency=2)], output_len=3,
                         request_timeout_s=0.3)
        url = srv.base_url
    assert res["runs"][0]["errors_by_kind"] == {"timeout": 2}
    assert res["runs"][0]["duration_s"] < 1.5
    # the server is gone now: nothing listens on that port
    res = bench_once(url, [RunSpec("closed", num_requests=3, concurrency=1)], warmup=0)
    assert res["runs"][0]["errors_by_kind"] == {"connect_error": 3}


def test_duration_bounds_a_run_and_requests_in_flight_finish():
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=0.1, itl_s=0.02)) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=1000, duration_s=0.6, concurrency=2)],
                         output_len=6)
    [run] = res["runs"]
    # each request takes 0.2 s: 2 workers start ~3 each before the 0.6 s deadline
    assert 4 <= run["num_requests"] <= 8, run["num_requests"]
    assert run["num_errors"] == 0
    assert run["duration_s"] < 0.6 + 0.2 + 0.15


def test_open_loop_sends_at_seeded_poisson_times_without_waiting():
    rate, n = 20.0, 12
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=0.1, itl_s=0.05)) as srv:
        res = bench_once(srv.base_url, [RunSpec("open", num_requests=n, request_rate=rate)], output_len=5,
                         seed=7)
    [run] = res["runs"]
    assert run["mode"] == "open" and run["request_rate"] == rate and run["concurrency"] is None
    assert run["label"] == "rate=20/s" and run["num_ok"] == n
    expected = poisson_arrivals(rate, n, seed=7)
    starts = [r["start_s"] for r in run["requests"]]
    assert all(abs(s - e) < 0.02 for s, e in zip(starts, expected)), (starts, expected)
    # each request lasts 0.3 s and arrivals are ~50 ms apart: several are in flight at once
    ends = [r["start_s"] + r["e2e_ms"] / 1000 for r in run["requests"]]
    overlap = max(sum(1 for s, e in zip(starts, ends) if s <= t < e) for t in starts)
    assert overlap >= 3
