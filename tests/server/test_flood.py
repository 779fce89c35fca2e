"""Overload: bounded queues answer at once; one tenant's flood does not hurt another."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, metric
from tests.server.test_tenancy import add_key


def _stream_ttft(url, key, max_tokens=8, results=None):
    """One streamed completion: (status, seconds to the first content chunk)."""
    body = {"model": MODEL, "prompt": "Name a color:", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"} if key else {}) as r:
        status = r.status_code
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                ttft = time.perf_counter() - t0
    if results is not None:
        results.append((status, ttft))
    return status, ttft


@pytest.mark.slow
def test_full_waiting_queue_is_refused_at_once():
    srv = ServerProcess("--max-num-seqs", "1", "--max-waiting", "1").wait_ready()
    try:
        threads = [threading.Thread(target=_stream_ttft, args=(srv.url, None, 300)) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while metric(srv, "tokenmill_num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert time.perf_counter() - t0 < 2.0 and r.headers["Retry-After"]
        for t in threads:
            t.join(120)
    finally:
        srv.stop()


@pytest.mark.slow
def test_flooding_tenant_does_not_hurt_another(tmp_path):
    db = tmp_path / "keys.db"
    key_a = add_key(db, "A", "--rpm", "60")
    key_b = add_key(db, "B", "--rpm", "6000")
    srv = ServerProcess("--keys-db", str(db), "--max-num-seqs", "8").wait_ready()
    try:
        _stream_ttft(srv.url, key_b)  # warm up

        def steady_b(results, n=12, gap=0.25):
            for _ in range(n):
                _stream_ttft(srv.url, key_b, results=results)
                time.sleep(gap)

        solo: list = []
        steady_b(solo)
        flood_results: list = []
        stop = threading.Event()

        def flood():  # ten times A's rate of one request a second, from many clients
            threads = []
            while not stop.is_set():
                t = threading.Thread(target=_stream_ttft, args=(srv.url, key_a, 24, flood_results))
                t.start()
                threads.append(t)
                time.sleep(0.1)
            for t in threads:
                t.join(120)

        flooder = threading.Thread(target=flood)
        flooder.start()
        time.sleep(1.0)
        loaded: list = []
        steady_b(loaded)
        stop.set()
        flooder.join(180)
        assert all(s == 200 for s, _ in loaded), loaded  # B is never refused
        assert any(s == 429 for s, _ in flood_results)  # A is held to its rate
        assert sum(s == 200 for s, _ in flood_results) >= 10  # ...but still served up to it

        def p99(xs):
            xs = sorted(t for _, t in xs)
            return xs[min(len(xs) - 1, int(0.99 * len(xs)))]

        print(f"B p99 TTFT solo {p99(solo) * 1000:.0f} ms, under A's flood {p99(loaded) * 1000:.0f} ms")
        assert p99(loaded) <= 2 * p99(solo)
    finally:
        srv.stop()
