"""The harness measures what a server with known timings does (the tool, not the engine).

The fake server sends the first chunk `ttft` after receiving the request and then one
chunk every `itl`, so TTFT, ITL, E2E and throughput have exact expected values. Delays
are 50-100 ms so that scheduling noise on a busy 2-core machine stays a small fraction;
tolerances are a few percent plus a few ms.
"""

from __future__ import annotations

import pytest

from tests.bench.fake_server import Behavior, FakeOpenAIServer
from tests.bench.helpers import bench_once
from tokenmill.bench.runner import RunSpec

TTFT, ITL, N = 0.100, 0.050, 10
E2E = TTFT + (N - 1) * ITL  # 0.55 s


def close(measured: float, expected: float, rel: float = 0.05, abs_ms: float = 0.0) -> bool:
    return abs(measured - expected) <= rel * expected + abs_ms


def test_single_stream_ttft_itl_e2e_and_throughput():
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=TTFT, itl_s=ITL)) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=4, concurrency=1)], output_len=N)
    [run] = res["runs"]
    assert run["num_ok"] == 4 and run["num_errors"] == 0
    assert close(run["ttft_ms"]["p50"], TTFT * 1000, abs_ms=5), run["ttft_ms"]
    assert close(run["ttft_ms"]["mean"], TTFT * 1000, abs_ms=5)
    assert close(run["itl_ms"]["p50"], ITL * 1000, abs_ms=3), run["itl_ms"]
    assert close(run["itl_ms"]["mean"], ITL * 1000, abs_ms=2)
    assert close(run["e2e_ms"]["p50"], E2E * 1000, abs_ms=5), run["e2e_ms"]
    # each request: N gaps-worth of records, output tokens from usage
    for r in run["requests"]:
        assert len(r["itl_ms"]) == N - 1
        assert r["output_tokens"] == N and r["usage_source"] == "usage"
        assert r["prompt_tokens"] == 8
    # decode rate per stream = (N-1) / (E2E - TTFT) = 1 / ITL
    assert close(run["decode_tokens_per_s_per_stream"]["p50"], 1 / ITL, rel=0.05)
    # one stream back to back: 4 requests * N tokens over 4 * E2E seconds
    assert close(run["output_tokens_per_s"], N / E2E, rel=0.05), run["output_tokens_per_s"]
    assert close(run["requests_per_s"], 1 / E2E, rel=0.05)
    assert run["input_tokens_total"] == 4 * 8 and run["output_tokens_total"] == 4 * N
    assert close(run["total_tokens_per_s"], (8 + N) / E2E, rel=0.05)
    # without objectives every successful request is good
    assert run["goodput_rps"] == pytest.approx(run["requests_per_s"])


def test_concurrency_sweep_throughput_scales_with_streams():
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=TTFT, itl_s=ITL)) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=8, concurrency=c) for c in (1, 4)],
                         output_len=N)
    one, four = res["runs"]
    assert [one["label"], four["label"]] == ["c=1", "c=4"]
    assert one["concurrency"] == 1 and four["concurrency"] == 4 and four["request_rate"] is None
    # c=1: 8 sequential requests; c=4: two waves of 4 in parallel
    assert close(one["duration_s"], 8 * E2E, rel=0.05), one["duration_s"]
    assert close(four["duration_s"], 2 * E2E, rel=0.05), four["duration_s"]
    assert close(four["output_tokens_per_s"], 8 * N / (2 * E2E), rel=0.05), four["output_tokens_per_s"]
    assert close(four["output_tokens_per_s"] / one["output_tokens_per_s"], 4.0, rel=0.06)
    # the fake server does not slow down with load, so latencies stay put; TTFT gets more
    # slack: 4 requests sent at once queue behind each other in this one Python process
    # (client and fake server), a few ms each when other work shares the 2 cores
    assert close(four["ttft_ms"]["p50"], TTFT * 1000, abs_ms=15), four["ttft_ms"]
    assert close(four["itl_ms"]["p50"], ITL * 1000, abs_ms=3)


def test_output_tokens_come_from_usage_not_chunk_count():
    # 5 chunks of 3 tokens: usage says 15; the ITL is per chunk arrival
    plan = lambda i, body: Behavior(ttft_s=0.05, itl_s=0.05, num_chunks=5, tokens_per_chunk=3)  # noqa: E731
    with FakeOpenAIServer(plan) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=2, concurrency=1)], output_len=15)
    [run] = res["runs"]
    for r in run["requests"]:
        assert r["output_tokens"] == 15 and r["num_chunks"] == 5 and r["usage_source"] == "usage"
        assert len(r["itl_ms"]) == 4
    assert run["output_tokens_total"] == 30
    assert close(run["itl_ms"]["mean"], 50, abs_ms=3)
    # decode rate counts tokens, not chunks: 14 tokens over 4 gaps of 50 ms
    assert close(run["decode_tokens_per_s_per_stream"]["p50"], 14 / 0.2, rel=0.05)


def test_no_usage_falls_back_to_counting_chunks_and_says_so():
    plan = lambda i, body: Behavior(ttft_s=0.02, itl_s=0.01, num_chunks=6, send_usage=False)  # noqa: E731
    with FakeOpenAIServer(plan) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=3, concurrency=1)], output_len=6)
    [run] = res["runs"]
    assert run["num_ok"] == 3
    assert run["usage_source"] == {"chunks": 3}
    assert all(r["output_tokens"] == 6 and r["prompt_tokens"] is None for r in run["requests"])


def test_chat_endpoint_ignores_role_only_chunk():
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=TTFT, itl_s=ITL)) as srv:
        res = bench_once(srv.base_url, [RunSpec("closed", num_requests=3, concurrency=1)],
                         output_len=5, endpoint="chat")
        body = srv.bodies[-1]
    [run] = res["runs"]
    assert run["num_ok"] == 3
    # the role chunk comes at once; TTFT must be the first *content* chunk
    assert close(run["ttft_ms"]["p50"], TTFT * 1000, abs_ms=5), run["ttft_ms"]
    assert body["messages"][0]["role"] == "user" and "prompt" not in body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_request_body_asks_for_streaming_usage_and_ignore_eos():
    with FakeOpenAIServer(lambda i, body: Behavior(ttft_s=0.01, itl_s=0.01)) as srv:
        bench_once(srv.base_url, [RunSpec("closed", num_requests=1, concurrency=1)], output_len=3)
        body = srv.bodies[-1]
    assert body["max_tokens"] == 3 and body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["model"] == "fake-model" and body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"].split()) == 8
