"""Clients that attack by doing nothing: a stream nobody reads is cut and its KV freed
(the reason counted), and hundreds of idle or slowloris sockets neither lock a real
client out nor stay open past the header timeout (tokenmill/server/connections.py)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, metric

pytestmark = pytest.mark.slow


def _labelled(srv: ServerProcess, name: str, label: str) -> float:
    """A counter's value for one label (0 before it is first counted)."""
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def test_a_stream_nobody_reads_is_cut_and_its_kv_freed():
    write_timeout = 2.0
    srv = ServerProcess("--write-timeout", str(write_timeout)).wait_ready()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills sooner
        sock.connect(("127.0.0.1", srv.port))
        # 16 samples with top_logprobs: tens of KB of events a step, so that the socket's
        # buffers fill in seconds on a slow machine (the 135M model's tokens alone take minutes)
        sock.sendall(_request("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "n": 16,
            "max_tokens": 4000, "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}))
        sent = time.monotonic()
        running_seen = False
        deadline = sent + 120
        while time.monotonic() < deadline:
            kv = metric(srv, "tokenmill_kv_blocks_used")
            running_seen = running_seen or kv > 0
            if _labelled(srv, "tokenmill_aborted_requests_total", 'reason="slow_client"') >= 1 and kv == 0:
                break
            time.sleep(0.25)
        took = time.monotonic() - sent
        print(f"a stream nobody reads was cut and its KV freed {took:.1f}s after it was sent "
              f"(--write-timeout {write_timeout}s)")
        assert running_seen, "the request never held KV blocks"
        assert took < 90
        assert _labelled(srv, "tokenmill_aborted_requests_total", 'reason="slow_client"') == 1
        assert metric(srv, "tokenmill_kv_blocks_used") == 0
        assert metric(srv, "tokenmill_num_requests_running") == 0
        generated = metric(srv, "tokenmill_generation_tokens_total")
        assert generated < 16 * 4000, "the request ran to its end instead of being aborted"
        assert _labelled(srv, "tokenmill_connections_closed_total", 'reason="write_stall"') == 1
        sock.settimeout(5)
        received = 0
        try:  # what the kernel holds, then the end (the transport's queue was dropped)
            while data := sock.recv(1 << 20):
                received += len(data)
        except ConnectionResetError:
            pass
        sock.close()
        print(f"the client could still read {received} bytes the kernel held")
        assert received < 1 << 20, "more than the bounded buffers' worth was queued for the client"
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_idle_and_slowloris_sockets_do_not_starve_a_real_client():
    cap, header_timeout = 150, 3.0
    srv = ServerProcess("--max-connections", str(cap), "--header-timeout", str(header_timeout)).wait_ready()
    idle: list[socket.socket] = []
    slow: list[socket.socket] = []
    stop = threading.Event()
    try:
        for _ in range(100):  # connect and say nothing
            s = socket.create_connection(("127.0.0.1", srv.port))
            idle.append(s)
        for _ in range(100):  # a request line, then a header byte every half second
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-a: ")
            slow.append(s)
        opened = time.monotonic()

        def trickle() -> None:
            while not stop.wait(0.5):
                for s in slow:
                    try:
                        s.send(b"a")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        real = time.monotonic() - t0
        print(f"a real request beside 200 idle/slowloris sockets (cap {cap}): {r.status_code} in {real:.2f}s")
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert real < 5.0
        assert _labelled(srv, "tokenmill_connections_closed_total", 'reason="evicted_idle"') >= 200 + 1 - cap
        assert cap - 10 <= metric(srv, "tokenmill_http_connections") <= cap

        time.sleep(max(0.0, opened + header_timeout + 1.5 - time.monotonic()))
        stop.set()
        closed = 0
        got_408 = 0
        for s in idle + slow:
            s.settimeout(2)
            try:
                data = s.recv(4096)
                got_408 += data.startswith(b"HTTP/1.1 408")
                while data:
                    data = s.recv(4096)
                closed += 1
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        print(f"after {header_timeout}s: {closed}/200 closed ({got_408} with a 408)")
        assert closed == 200
        assert got_408 >= 1
        timed_out = _labelled(srv, "tokenmill_connections_closed_total", 'reason="header_timeout"')
        evicted = _labelled(srv, "tokenmill_connections_closed_total", 'reason="evicted_idle"')
        assert timed_out + evicted == 200, (timed_out, evicted)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert metric(srv, "tokenmill_http_connections") <= 2  # the scrape's own, and one closing
    finally:
        stop.set()
        for s in idle + slow:
            s.close()
        srv.stop()


def test_a_trickled_body_gets_408_and_never_reaches_the_engine():
    """Headers at once, then the JSON body a byte a second: past --body-timeout the server
    answers 408 and closes, nothing is scheduled, and no route error is logged."""
    body_timeout = 2.0
    srv = ServerProcess("--body-timeout", str(body_timeout), "--log-level", "info").wait_ready()
    try:
        request = _request("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
        head, _, data = request.partition(b"\r\n\r\n")
        prompt_tokens = metric(srv, "tokenmill_prompt_tokens_total")
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(head + b"\r\n\r\n")
        s.settimeout(1.0)
        t0 = time.monotonic()
        reply = b""
        for byte in data[:-1]:  # never the last byte
            try:
                s.sendall(bytes([byte]))
                reply += s.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if reply.endswith(b"\r\n\r\n") or time.monotonic() - t0 > 20:
                break
        cut = time.monotonic() - t0
        s.close()
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert body_timeout - 0.5 < cut < body_timeout + 3.0, cut
        assert _labelled(srv, "tokenmill_connections_closed_total", 'reason="body_timeout"') == 1
        assert metric(srv, "tokenmill_prompt_tokens_total") == prompt_tokens  # nothing reached the engine
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        print(f"a body trickled a byte a second: 408 after {cut:.2f}s (--body-timeout {body_timeout})")
    finally:
        out = srv.stop()
    assert "Traceback" not in out and "unhandled error" not in out, out
