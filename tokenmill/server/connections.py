"""Guards for the sockets themselves, which uvicorn leaves open to a hostile client.

uvicorn reads a connection for as long as the peer likes: one that connects and says
nothing, or sends its headers a byte a minute (slowloris), holds a socket forever, and
`limit_concurrency` counts those sockets but answers 503 only to requests whose headers
are complete, so a few thousand of them lock real clients out. A client that stops
reading a stream stalls the response's `send` once the socket's buffers fill, and its
request holds its KV blocks until it ends on its own.

So the server runs uvicorn with its own HTTP protocol class (`guarded_protocol`): a
subclass of uvicorn's httptools protocol, one instance per connection, that owns the
socket's transport and adds:

- a header timeout: from the moment a connection opens, or the first byte of the next
  request on a kept-alive one, its request line and headers must be complete within
  `header_timeout_s`, or it gets a 408 and is closed;
- a body timeout: a request's body must be complete within `body_timeout_s` of its
  headers, a deadline that grows by a second for every `BODY_MIN_RATE` bytes received,
  or it gets a 408 and is closed; the app's `receive` sees a disconnect, so an
  incomplete body never reaches a route (a client that trickles a byte a second is cut
  at `body_timeout_s`; a large upload over a slow link is not). An idle-gap bound would
  not do: a byte every few seconds resets it forever. Time while the server itself holds
  the body back (uvicorn pauses reading while the app has not consumed what came) is
  not the client's, so the deadline waits for it;
- a connection cap: past `max_connections` open sockets, a new one closes the idle
  connection (no request in flight: connected, reading headers, or kept alive) that has
  been idle longest, so a flood of idle sockets cannot lock a real client out; when
  every connection has a request in flight, the new one gets a 503 and is closed;
- a bounded send buffer and a write timeout: an event stream's socket gets a fixed
  kernel send buffer (`STREAM_SNDBUF`; Linux otherwise grows it to 4 MiB, more than a
  whole generation's events), and uvicorn's flow control makes the app's `send` wait
  once 64 KiB more are queued on the transport; when a connection's writes stay paused
  for `write_timeout_s` because its peer reads nothing, the connection is dropped (its
  queued bytes discarded). The app sees the disconnect, which aborts the request in the engine and
  frees its KV blocks as for any client that goes away; the cut is counted as
  `tokenmill_aborted_requests{reason="slow_client"}` when a response was in flight.

Each cut is counted by reason (`on_cut`): `tokenmill_connections_closed{reason=...}`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# An event stream's kernel send buffer (Linux doubles it: 128 KiB). Tokens come at a few
# KB/s, so it never limits a reader: over a 100 ms round trip it still carries ~1 MB/s.
STREAM_SNDBUF = 64 * 1024
# A body's deadline grows by a second for each this many bytes (a 512 kbit/s link): an
# upload of the largest allowed file still fits, a trickle does not.
BODY_MIN_RATE = 64 * 1024
_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_503_BODY = b"too many connections"
_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
        + str(len(_503_BODY)).encode() + b"\r\nretry-after: 1\r\nconnection: close\r\n\r\n" + _503_BODY)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 2048
    header_timeout_s: float = 10.0
    write_timeout_s: float = 30.0
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or min(self.header_timeout_s, self.write_timeout_s, self.body_timeout_s) <= 0:
            raise ValueError("the connection cap and the header, body and write timeouts must be positive")


class GuardedProtocol(HttpToolsProtocol):
    limits: ConnectionLimits = ConnectionLimits()
    on_cut: Callable[[str, bool], None] = staticmethod(lambda reason, in_flight: None)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline = 0.0  # (loop time) the body's deadline before the bytes that came
        self._body_bytes = 0
        self._idle_since = time.monotonic()
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            self._cut("connection_cap", _503)
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and not self._in_flight():
            self._arm_header_timer()  # the first byte of a kept-alive connection's next request
        super().data_received(data)

    def on_headers_complete(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not None and self.cycle is not previous:  # (not an upgrade)
            self._bound_streams(self.cycle)
            self._arm_body_timer()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # -- the guards ------------------------------------------------------------------
    def _bound_streams(self, cycle) -> None:
        """Give the socket a small send buffer when this request's response is an event
        stream (the kernel's own would hold megabytes of a reader that reads nothing)."""
        send = cycle.send

        async def guarded_send(message) -> None:
            if message["type"] == "http.response.start" and any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in message.get("headers", ())):
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
                    except OSError:
                        pass
            await send(message)

        cycle.send = guarded_send

    def _in_flight(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self._in_flight():
            self._cut("header_timeout", _408)

    def _arm_body_timer(self) -> None:
        """(For every request: one without a body completes in the same read, which cancels it.)"""
        self._body_bytes = 0
        self._body_deadline = self.loop.time() + self.limits.body_timeout_s
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_late)

    def _body_late(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server holds the body back, not the client: wait for it
            self._body_deadline = self.loop.time() + self.limits.body_timeout_s
            self._body_bytes = 0
        left = self._body_deadline + self._body_bytes / BODY_MIN_RATE - self.loop.time()
        if left > 0:
            self._body_timer = self.loop.call_later(left, self._body_late)
            return
        started = cycle.response_started
        self._cut("body_timeout", None if started else _408)
        # the app's `receive` answers a disconnect from now on; whatever it sends is dropped
        cycle.disconnected = True
        cycle.message_event.set()

    def _write_stalled(self) -> None:
        self._write_timer = None
        self._cut("write_stall", None)

    def _evict_idle(self) -> bool:
        """Close the connection idle longest to make room; False when none is idle."""
        idle = [c for c in self.connections if isinstance(c, GuardedProtocol) and c is not self
                and not c._in_flight() and c.transport is not None and not c.transport.is_closing()]
        if not idle:
            return False
        min(idle, key=lambda c: c._idle_since)._cut("evicted_idle", None)
        return True

    def _cut(self, reason: str, reply: bytes | None) -> None:
        self._cancel_timers()
        self.on_cut(reason, self._in_flight())
        if reply is None:
            self.transport.abort()  # nothing to say, or a peer that reads nothing: drop the queued bytes
            return
        self.transport.write(reply)
        self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._write_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = self._body_timer = None


def guarded_protocol(limits: ConnectionLimits, on_cut: Callable[[str, bool], None]) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=` (one server's limits and counter)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits, "on_cut": staticmethod(on_cut)})
