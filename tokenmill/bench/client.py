"""Send one streaming request to an OpenAI-compatible server and time it.

Timing definitions (also written into every report):

- TTFT: from just before the request is sent to the arrival of the first SSE chunk that
  carries generated text (chat role-only chunks and empty-text chunks do not count).
- ITL (inter-token latency): the gaps between consecutive content-bearing SSE chunks.
  A chunk carrying k tokens is one arrival, so a server that batches tokens into chunks
  shows fewer, longer gaps; the per-stream decode rate below is unaffected by that.
- E2E: from send to the end of the stream (`data: [DONE]` or the connection closing).
- Output tokens: `usage.completion_tokens` of the last chunk that carries usage (we ask
  for it with `stream_options.include_usage`); if the server sends none, the number of
  content chunks, and the record says `usage_source: "chunks"`.
- Decode tokens/s per stream: (output_tokens - 1) / (E2E - TTFT).
- Cached tokens: `usage.prompt_tokens_details.cached_tokens` (prompt tokens the server's
  prefix cache served), None where the server does not say.

Nothing here raises for a failed request: every failure becomes a record with `ok=False`
and an `error_kind` (`http_500`, `http_429`, `connection_dropped`, `timeout`,
`truncated_stream` (no finish_reason before [DONE]), ...).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

import httpx

from tokenmill.bench.workload import RequestSpec

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class ClientConfig:
    """How each request is phrased; shared by every request of a benchmark."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: Optional[str] = None
    request_timeout_s: float = 600.0
    # Merged last into every body: server-specific knobs (e.g. a logit_bias that bans EOS
    # on a server without ignore_eos). A dict inside a frozen dataclass: treat as read-only.
    extra_body: Optional[dict[str, Any]] = None

    def url(self) -> str:
        path = "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"
        return self.base_url.rstrip("/").removesuffix("/v1") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    """What one request measured. Times are ms; `start_s` is seconds from the run start."""

    index: int
    ok: bool = False
    error_kind: Optional[str] = None
    error: Optional[str] = None
    start_s: float = 0.0
    ttft_ms: Optional[float] = None
    e2e_ms: Optional[float] = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: Optional[int] = None
    output_tokens: int = 0
    requested_output_tokens: int = 0
    requested_input_tokens: Optional[int] = None
    usage_source: Optional[str] = None  # "usage" | "chunks"
    num_chunks: int = 0
    finish_reason: Optional[str] = None
    cached_tokens: Optional[int] = None
    conversation: Optional[int] = None  # agent workload: which conversation, which turn (from 0)
    turn: Optional[int] = None

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        if not self.ok or self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        decode_s = (self.e2e_ms - self.ttft_ms) / 1000.0
        return (self.output_tokens - 1) / decode_s if decode_s > 0 else None

    @property
    def mean_itl_ms(self) -> Optional[float]:
        return sum(self.itl_ms) / len(self.itl_ms) if self.itl_ms else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


def build_body(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body for `spec`: streaming, usage requested, greedy unless told otherwise."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": spec.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a common extension (vLLM, llama.cpp, tokenmill)
    if cfg.endpoint == "chat":
        body["messages"] = spec.messages or [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body.update(cfg.extra_body or {})
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    """Generated text in one parsed SSE chunk, for either endpoint."""
    parts = []
    for choice in obj.get("choices") or []:
        if "text" in choice and choice["text"]:
            parts.append(choice["text"])
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content"):
            if delta.get(key):
                parts.append(delta[key])
    return "".join(parts)


def _finish_reason(obj: dict[str, Any]) -> Optional[str]:
    for choice in obj.get("choices") or []:
        if choice.get("finish_reason"):
            return str(choice["finish_reason"])
    return None


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException)):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection_dropped"
    if isinstance(exc, httpx.ReadError):
        return "read_error"
    if isinstance(exc, json.JSONDecodeError):
        return "bad_json"
    return f"client_{type(exc).__name__}"


async def _consume(resp: httpx.Response, rec: RequestRecord, t0: float,
                   text_out: Optional[list[str]]) -> None:
    """Read the SSE stream into `rec` (times relative to `t0`, perf_counter seconds) and
    the generated text into `text_out` when given."""
    last_t: Optional[float] = None
    usage_tokens: Optional[int] = None
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, `event:` and `:` comment lines
        now = time.perf_counter()
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        obj = json.loads(payload)
        if "error" in obj and not obj.get("choices"):
            rec.error_kind = "stream_error"
            rec.error = str(obj["error"])[:300]
            return
        usage = obj.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                rec.cached_tokens = int(cached)
        rec.finish_reason = _finish_reason(obj) or rec.finish_reason
        text = _chunk_text(obj)
        if text:
            if text_out is not None:
                text_out.append(text)
            rec.num_chunks += 1
            if last_t is None:
                rec.ttft_ms = (now - t0) * 1000.0
            else:
                rec.itl_ms.append((now - last_t) * 1000.0)
            last_t = now
    rec.e2e_ms = (time.perf_counter() - t0) * 1000.0
    if rec.finish_reason is None:
        # Cut short: the body ended, or [DONE] came (llama-cpp-python does this to a stream
        # it interrupts for a newer request), before any choice said why it finished.
        rec.error_kind = "truncated_stream" if done else "incomplete_stream"
        rec.error = f"stream ended after {rec.num_chunks} content chunks without a finish_reason"
        return
    if usage_tokens is not None:
        rec.output_tokens, rec.usage_source = usage_tokens, "usage"
    else:
        rec.output_tokens, rec.usage_source = rec.num_chunks, "chunks"
    if rec.num_chunks == 0:
        rec.error_kind, rec.error = "no_tokens", "the stream finished without any generated text"
        return
    rec.ok = True


async def send_request(client: httpx.AsyncClient, cfg: ClientConfig, spec: RequestSpec,
                       run_t0: float, text_out: Optional[list[str]] = None) -> RequestRecord:
    """Send `spec`, stream the answer (its text appended to `text_out` when given), and
    return its record; never raises (except on cancellation, which is the caller's to decide)."""
    rec = RequestRecord(index=spec.index, requested_output_tokens=spec.max_tokens,
                        requested_input_tokens=spec.input_len, conversation=spec.conversation,
                        turn=spec.turn)
    t0 = time.perf_counter()
    rec.start_s = t0 - run_t0
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            async with client.stream("POST", cfg.url(), json=build_body(cfg, spec),
                                     headers=cfg.headers()) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread())[:300].decode("utf-8", "replace")
                    rec.error_kind, rec.error = f"http_{resp.status_code}", body
                else:
                    await _consume(resp, rec, t0, text_out)
    except (httpx.HTTPError, asyncio.TimeoutError, json.JSONDecodeError, ValueError, OSError) as exc:
        rec.ok = False
        rec.error_kind, rec.error = _error_kind(exc), f"{type(exc).__name__}: {exc}"[:300]
    if rec.e2e_ms is None:
        rec.e2e_ms = (time.perf_counter() - t0) * 1000.0
    return rec
