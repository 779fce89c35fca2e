"""The connection guards (tokenmill/server/connections.py) on a real uvicorn server with
a small ASGI app, no model: the cap refuses a connection only when none is idle, and a
kept-alive connection's next request has the header timeout too."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from tests.server.conftest import free_port
from tokenmill.server.connections import ConnectionLimits, guarded_protocol


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
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
