"""SIGTERM: stop admitting (503), let in-flight requests finish by a deadline, exit 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess


def _stream(url, max_tokens, out, started):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    out.append(chunk["choices"][0])
                    started.set()


def _start(url, max_tokens):
    out: list = []
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(url, max_tokens, out, started), daemon=True)
    t.start()
    assert started.wait(60)
    return t, out


@pytest.mark.slow
@pytest.mark.parametrize("to", ["server", "group"])
def test_sigterm_drains_in_flight_and_exits_zero(to):
    # "group": Ctrl-C or a service manager signals every process of the group, the engine
    # child too; it must leave the shutdown to the server, not die and be restarted.
    srv = ServerProcess("--shutdown-timeout", "60", "--log-level", "info", new_session=True).wait_ready()
    try:
        t, out = _start(srv.url, 400)  # still decoding after the 0.3 s below, even at ~150 tok/s
        if to == "group":
            os.killpg(srv.proc.pid, signal.SIGTERM)
        else:
            srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 503
        t.join(120)
        assert out[-1]["finish_reason"] == "length"  # the in-flight request finished normally
        assert srv.proc.wait(60) == 0
        log = srv.proc.stdout.read()
        assert "restarting" not in log and "engine process failed" not in log, log[-2000:]
    finally:
        srv.stop()


@pytest.mark.slow
def test_sigterm_deadline_aborts_the_rest():
    srv = ServerProcess("--shutdown-timeout", "1").wait_ready()
    try:
        t, out = _start(srv.url, 5000)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert out[-1]["finish_reason"] == "abort"
        assert len(out) < 5000
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
