"""`cluster serve --replicas auto`: Ray Serve adds a replica under load and removes it after."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.cluster.conftest import ray_processes
from tests.server.conftest import MODEL, ServerProcess, metric

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}")


def test_replicas_follow_the_load():
    srv = ServerProcess("--replicas", "auto", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing", "1",
                        "--scale-down-delay", "5", "--num-threads", "1", "--no-batch-api",
                        command=("cluster", "serve")).wait_ready(timeout=300)
    stop = threading.Event()
    codes: list[int] = []

    def client(i: int) -> None:
        while not stop.is_set():
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": f"Load {i}: tell a story.", "max_tokens": 64,
                                 "ignore_eos": True, "temperature": 0})
            codes.append(r.status_code)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    try:
        wait_for(lambda: metric(srv, "tokenmill_replicas") == 1, 30, "the first replica's report")
        for t in threads:
            t.start()
        wait_for(lambda: metric(srv, "tokenmill_replicas") == 2, 90, "a second replica under load")
        stop.set()
        for t in threads:
            t.join()
        assert codes and set(codes) == {200}, codes  # nothing failed while it scaled
        wait_for(lambda: metric(srv, "tokenmill_replicas") == 1, 90, "the load's end to remove it")
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200
    finally:
        stop.set()
        srv.stop()
    wait_for(lambda: not ray_processes(), 60, "its Ray cluster to stop")
