"""A tiny OpenAI-compatible SSE server with known timings, for testing the harness.

It runs its own asyncio loop in a thread on 127.0.0.1 (a free port) and speaks just
enough HTTP/1.1: keep-alive, chunked transfer encoding, GET /v1/models and streaming
POST /v1/completions and /v1/chat/completions. What each request gets is decided by a
`plan(arrival_index, body) -> Behavior`, so a test knows the true TTFT, ITL and token
count of every request it makes. Chunks are sent on an absolute schedule (first at
receipt + ttft, the k-th at + k*itl), so sleep jitter does not accumulate.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

Kind = Literal["ok", "http_500", "http_429", "drop_mid_stream", "drop_before_response", "stream_error",
               "truncate", "eos_early"]


@dataclass(frozen=True)
class Behavior:
    """How to answer one request: `num_chunks` content chunks of `tokens_per_chunk`
    tokens each (default: max_tokens chunks of one token), the first after `ttft_s`,
    then one every `itl_s`; usage in a final chunk unless `send_usage` is False."""

    ttft_s: float = 0.1
    itl_s: float = 0.05
    kind: Kind = "ok"
    num_chunks: Optional[int] = None
    tokens_per_chunk: int = 1
    send_usage: bool = True
    stall_at: Optional[int] = None  # chunk index before which the stream stalls once...
    stall_s: float = 0.0  # ...for this long (every later chunk shifts by it)
    cached_tokens: Optional[int] = None  # usage.prompt_tokens_details.cached_tokens, when given


Plan = Callable[[int, dict[str, Any]], Behavior]


class FakeOpenAIServer:
    """Start with `with FakeOpenAIServer(plan) as srv:`; `srv.base_url`, `srv.bodies`."""

    def __init__(self, plan: Plan, model: str = "fake-model") -> None:
        self.plan = plan
        self.model = model
        self.bodies: list[dict[str, Any]] = []  # request bodies in arrival order
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: Optional[asyncio.base_events.Server] = None
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        port = fut.result(timeout=10)
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        # Abort open connections: their handlers then end on a read error, uncancelled.
        for writer in list(self._writers):
            writer.transport.abort()
        await asyncio.sleep(0.01)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:  # keep-alive: several requests per connection
                head = await reader.readuntil(b"\r\n\r\n")
                received = self._loop.time()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in
                           (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path == "/v1/models":
                    self._json(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    body = json.loads(raw)
                    index = len(self.bodies)
                    self.bodies.append(body)
                    if not await self._stream(writer, body, self.plan(index, body), received,
                                              chat=path.endswith("chat/completions")):
                        return
                else:
                    self._json(writer, 404, {"error": {"message": "not found"}})
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _json(self, writer: asyncio.StreamWriter, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    async def _stream(self, writer: asyncio.StreamWriter, body: dict[str, Any], b: Behavior,
                      received: float, chat: bool) -> bool:
        """Answer one completion request; False when the connection was dropped on purpose."""
        if b.kind == "drop_before_response":
            writer.transport.abort()
            return False
        if b.kind in ("http_500", "http_429"):
            await asyncio.sleep(b.ttft_s)
            self._json(writer, int(b.kind[5:]), {"error": {"message": b.kind}})
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")

        def event(obj: Any) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        if chat:  # a role-only first chunk, as OpenAI sends: it must not count as a token
            event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await writer.drain()
        n = b.num_chunks if b.num_chunks is not None else int(body.get("max_tokens", 16))
        for k in range(n):
            stall = b.stall_s if b.stall_at is not None and k >= b.stall_at else 0.0
            await asyncio.sleep(max(0.0, received + b.ttft_s + k * b.itl_s + stall - self._loop.time()))
            if b.kind == "drop_mid_stream" and k == 2:
                writer.transport.abort()  # no terminating chunk: the client sees a broken body
                return False
            if b.kind == "stream_error" and k == 1:
                event({"error": {"message": "engine failed", "type": "server_error"}})
                break
            if b.kind == "truncate" and k == 2:
                break  # [DONE] without a finish_reason, as an interrupted stream ends
            if b.kind == "eos_early" and k == n // 2:
                n = k
                break
            text = "tok " * b.tokens_per_chunk
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            event({"choices": [choice | {"finish_reason": None}]})
            await writer.drain()
        if b.kind in ("ok", "eos_early"):
            last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            event({"choices": [last | {"finish_reason": "length" if b.kind == "ok" else "stop"}]})
            if b.send_usage:
                prompt = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n * b.tokens_per_chunk,
                         "total_tokens": len(prompt.split()) + n * b.tokens_per_chunk}
                if b.cached_tokens is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": b.cached_tokens}
                event({"choices": [], "usage": usage})
        event("[DONE]")
        writer.write(b"0\r\n\r\n")
        return True
