"""The connection guards (tokenmill/server/connections.py) on a real uvicorn server with
a small ASGI app, no model: the cap refuses a connection only when none is idle, a
kept-alive connection's next request has the header timeout too, and a trickled body is
cut by the body timeout before the app sees it whole."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from tests.server.conftest import free_port
from tokenmill.server.connections import ConnectionLimits, guarded_protocol


_BODIES: list[bytes | None] = []  # what /echo read: a whole body, or None for a disconnect


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/echo":
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                _BODIES.append(None)
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        _BODIES.append(body)
        reply = str(len(body)).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    if scope["path"] == "/slow":
        await asyncio.sleep(2.0)
    await send({"type": "http.response.body", "body": b"ok"})


class _Server:
    def __init__(self, limits: ConnectionLimits):
        self.port = free_port()
        self.cuts: list[tuple[str, bool]] = []
        config = uvicorn.Config(_app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off",
                                http=guarded_protocol(limits, lambda *cut: self.cuts.append(cut)))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "_Server":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        s.settimeout(5)
        return s


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while data := s.recv(4096):
            out += data
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def test_the_cap_evicts_an_idle_connection_and_refuses_only_when_all_are_busy():
    with _Server(ConnectionLimits(max_connections=2, header_timeout_s=30, write_timeout_s=30)) as srv:
        busy = [srv.connect() for _ in range(2)]
        for s in busy:
            s.sendall(_get("/slow"))  # two requests in flight: nothing to evict
        time.sleep(0.3)
        third = srv.connect()
        reply = _read_all(third)
        assert reply.startswith(b"HTTP/1.1 503") and b"too many connections" in reply
        assert ("connection_cap", False) in srv.cuts
        for s in busy:  # the requests in flight were not touched
            reply = b""
            while not reply.endswith(b"\r\n\r\nok"):
                reply += s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200")
        # now both are idle (kept alive): a new connection closes the one idle longest
        fourth = srv.connect()
        fourth.sendall(_get("/"))
        assert fourth.recv(4096).startswith(b"HTTP/1.1 200")
        assert ("evicted_idle", False) in srv.cuts
        assert _read_all(busy[0]) == b""  # the older idle one was closed
        for s in (*busy, third, fourth):
            s.close()


def test_a_kept_alive_connection_has_the_header_timeout_for_its_next_request():
    with _Server(ConnectionLimits(max_connections=16, header_timeout_s=1.0, write_timeout_s=30)) as srv:
        s = srv.connect()
        s.sendall(_get("/"))
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")  # the next request's headers, never finished
        t0 = time.monotonic()
        reply = _read_all(s)
        waited = time.monotonic() - t0
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert 0.8 < waited < 3.0, waited
        assert srv.cuts == [("header_timeout", False)]
        s.close()


def _post_head(length: int) -> bytes:
    return f"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n\r\n".encode()


def test_a_trickled_body_is_cut_with_408_before_the_app_sees_it():
    """Headers at once, then a byte every 0.25 s: the header timeout is satisfied, the body
    timeout is not; the app's receive ends in a disconnect, never with the body."""
    _BODIES.clear()
    with _Server(ConnectionLimits(max_connections=16, header_timeout_s=30, write_timeout_s=30,
                                  body_timeout_s=1.0)) as srv:
        s = srv.connect()
        s.sendall(_post_head(100))
        t0 = time.monotonic()
        reply = b""
        s.settimeout(0.25)
        for _ in range(40):  # 10 s of trickle at most
            try:
                s.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                continue
            reply += chunk
            if not chunk or reply.endswith(b"\r\n\r\n"):
                break
        waited = time.monotonic() - t0
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert 0.8 < waited < 3.0, waited
        assert srv.cuts == [("body_timeout", True)]  # (a request was in flight)
        deadline = time.monotonic() + 5
        while not _BODIES and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _BODIES == [None]  # the app saw a disconnect, not the body
        s.close()


def test_a_slow_but_steady_body_past_the_timeout_is_served():
    """The deadline grows with the bytes received (BODY_MIN_RATE): 256 KiB sent in 1.6 s,
    past a 1 s body timeout but well above the minimum rate, is served whole."""
    _BODIES.clear()
    with _Server(ConnectionLimits(max_connections=16, header_timeout_s=30, write_timeout_s=30,
                                  body_timeout_s=1.0)) as srv:
        s = srv.connect()
        size, chunk = 256 * 1024, 16 * 1024
        s.sendall(_post_head(size))
        for _ in range(size // chunk):
            s.sendall(b"y" * chunk)
            time.sleep(0.1)
        reply = b""
        while not reply.endswith(str(size).encode()):
            data = s.recv(4096)
            assert data, reply
            reply += data
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert srv.cuts == [] and _BODIES == [b"y" * size]
        s.close()
