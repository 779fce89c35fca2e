"""The serving layer shared by chat and completions: protocol -> engine -> responses.

Routes stay thin; this turns a validated body into token ids and SamplingParams,
runs it on the engine client, and turns engine outputs back into OpenAI JSON or
SSE chunks. A client that goes away aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, StreamingResponse

from tokenmill.engine.api import (CACHE_TTLS, AdmissionError, EngineClient, EngineDeadError, InvalidParameter,
                                  ModelHost, ModelUnavailable, Priority, RequestOutput, ResolvedParams, SamplingParams,
                                  Snapshot, SnapshotMismatch, UnknownModel, split_snapshot_id)
from tokenmill.model.tokenizer import Tokenizer
from tokenmill.server.errors import APIError, as_api_error
from tokenmill.server.metrics import Metrics


class SpecTally:
    """A response's speculative decoding figures (the usage extension `speculative`):
    drafts checked and accepted, summed over its samples (each output carries its
    sample's running totals)."""

    def __init__(self) -> None:
        self._per: dict[tuple[int, int], tuple[int, int]] = {}
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def add(self, out: RequestOutput, prompt: int = 0) -> None:
        key = (prompt, out.index)
        d0, a0 = self._per.get(key, (0, 0))
        self.draft_tokens += out.num_draft_tokens - d0
        self.accepted_tokens += out.num_accepted_tokens - a0
        self._per[key] = (out.num_draft_tokens, out.num_accepted_tokens)

    def as_dict(self) -> dict[str, int]:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}


@dataclass
class RequestContext:
    """Who is asking and under what terms (filled by the gate before serving), and what
    the request has used so far. `finish()` runs the settlement callbacks exactly once;
    the app's middleware calls it when the HTTP exchange ends, however it ends."""
    request_id: str  # our id, unique: the engine's key and the response's `id`
    tenant: str | None = None
    model: str | None = None  # what the request named (a model or a LoRA adapter); None: the default
    base_model: str | None = None  # the model under `model` when that is a LoRA adapter
    limits: Any = None  # the tenant's TenantLimits when a gate admitted it
    priority: int = Priority.INTERACTIVE
    deadline: float | None = None  # time.monotonic() after which the work is abandoned
    gate: Any = None  # the Gate that admitted it, for the token phase
    rate_limited: bool = True  # False for Batch API lines: the runner paces them, not the tenant's buckets
    usage: dict[str, Any] | None = None  # the latest usage (partial while streaming)
    usage_hooks: list[Callable[[RequestContext, dict[str, Any]], None]] = field(default_factory=list)
    finalizers: list[Callable[[dict[str, Any] | None], None]] = field(default_factory=list)
    trace: Any = None  # tokenmill.server.telemetry.RequestTrace, when observed
    capture: Any = None  # tokenmill.server.capture.Recording, when the request is captured
    route: Any = None  # tokenmill.server.traffic.Route: the rollout arm it was placed on, if any
    params: Any = None  # the ResolvedParams it runs with, once prepared
    observers: list[Callable[[RequestOutput], None]] = field(default_factory=list)  # see every engine output
    cost_usd: float | None = None  # what it was priced at (set by the pricer when it settles)
    status_code: int = 200  # the HTTP status it ended with
    _finished: bool = False

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        for f in self.finalizers:
            f(self.usage)
        if self.trace is not None:  # after every finalizer, not one of them: the pricer's sets cost_usd
            self.trace.end(self.status_code, self.usage)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def per_model(method):
    """Run a serving entry point (its first argument: a body naming a model) on the
    serving object of that model: each model has its own tokenizer, name and template."""
    @functools.wraps(method)
    async def run(self, body, *args, **kwargs):
        own = self.for_model(body.model)
        return await method(own, body, *args, **kwargs)

    return run


class BaseServing:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model_name: str, metrics: Metrics):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        # what the answers depend on (system_fingerprint; a pinned `model` must match it):
        # the engine's snapshot, with the server's own chat template when it has one (build_app)
        self.snapshot: Snapshot | None = engine.served(model_name).snapshot
        self.aliases: dict[str, Any] = {}  # name -> tokenmill.server.aliases.ModelAlias
        # a rollout's name -> its stable model, None for another name (Traffic.stable_model)
        self.rollout_stable: Callable[[str | None], str | None] = lambda name: None
        self.siblings: dict[str, BaseServing] = {model_name: self}  # one per model the engine serves
        self._host = engine if isinstance(engine, ModelHost) else None  # models loaded on demand
        self._token_strs: dict[int, str] = {}  # logprobs name tokens; a vocabulary's worth at most

    # -- request side -------------------------------------------------------------------
    def check_model(self, model: str | None, ctx: RequestContext | None = None) -> str:
        """The engine client says which names it serves (the one namespace of models and
        LoRA adapters): the name it serves `model` under. An alias stands for its target;
        a pinned snapshot id must name the snapshot served; a key limited to some names
        gets the same 404 for the others. With `ctx`, the request runs on that model or
        adapter from here on."""
        alias = self.aliases.get(model) if model is not None else None
        # a rollout's name the ingress did not place (a dialect's early check, tokenize) is its stable model
        target = alias.target if alias is not None else (self.rollout_stable(model) or model)
        name, pin = split_snapshot_id(target) if target is not None else (None, None)
        allowed = getattr(ctx.limits, "allowed_models", None) if ctx is not None else None
        try:
            rollout = ctx.route.rollout.name if ctx is not None and ctx.route is not None else None
            if allowed is not None and model not in allowed and name not in allowed and rollout not in allowed:
                raise UnknownModel(model, allowed)
            served = self.engine.served(name)
        except UnknownModel as exc:
            raise APIError(404, str(exc), param="model", code="model_not_found") from None
        if ctx is not None:
            ctx.model, ctx.base_model = served.name, served.parent
        if pin is None:
            return served.name
        snapshot = self.snapshot if name == self.model_name else served.snapshot
        try:
            if snapshot is None:
                raise SnapshotMismatch(target, f"{name} (a model without files: no snapshot)")
            snapshot.check(target)
        except SnapshotMismatch as exc:
            raise APIError(409, str(exc), param="model", code="snapshot_mismatch") from None
        return served.name

    def answered_by(self, ctx: RequestContext) -> str:
        """The name a response reports: the model or adapter the request named."""
        return ctx.model or self.model_name

    @property
    def fingerprint(self) -> str | None:
        return self.snapshot.id if self.snapshot is not None else None

    def check_generates(self) -> None:
        """An embedding model (an encoder) answers generation with a clear 400."""
        spec = self.engine.served(self.model_name).embedding
        if spec is not None and not spec.generates:
            raise APIError(400, f"{self.model_name} is an embedding model: it serves /v1/embeddings and "
                                "/v1/rerank, not text generation", param="model", code="model_not_supported")

    def for_model(self, model: str | None):
        """The serving object of `model` (404 for a name not served)."""
        return self.siblings.get(self.check_model(model), self)

    async def hold_model(self, ctx: RequestContext, keep_alive: float | None):
        """With models loaded on demand (ModelHost): this model loaded and held until the
        request ends (ctx.finish), so that it can be resolved and run; None otherwise."""
        if self._host is None:
            return None
        try:
            lease = await self._host.acquire(self.model_name, keep_alive)
        except ModelUnavailable as exc:
            raise as_api_error(exc) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        ctx.finalizers.append(lambda _usage: lease.release())
        return lease

    async def encode(self, text: str, param: str, **kwargs) -> list[int]:
        """Tokenize off the event loop: a long prompt takes a while, and other streams and
        /health must not wait for it. JSON may carry lone surrogates (\\ud800), which are
        not Unicode text: those are the client's error (`param`), not the tokenizer's."""
        def run() -> list[int]:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{param} is not valid Unicode text (it holds a lone surrogate)",
                               param=param) from None
            return self.tokenizer.encode(text, **kwargs)

        return await asyncio.to_thread(run)

    def prepare(self, ctx: RequestContext, prompts: list[list[int]], params: SamplingParams,
                renames: dict[str, str] | None = None) -> ResolvedParams:
        """The request resolved, once (ServedModel.resolve: every bound, the model's
        defaults where the client said nothing, the tenant's output cap), then its tokens
        reserved by the gate. Returns what the engine runs."""
        num_prompt = sum(len(ids) for ids in prompts)
        try:
            served = self.engine.served(ctx.model or self.model_name)
            if params.pooling is None:
                self.check_generates()
            cap = ctx.gate.output_cap(ctx, num_prompt, params.n) if ctx.gate is not None else None
            resolved = served.resolve(prompts, params, cap=cap)
        except InvalidParameter as exc:
            param = (renames or {}).get(exc.param, exc.param)  # name it as the client spelled it
            raise APIError(400, str(exc).replace(exc.param, param, 1), param=param) from None
        except AdmissionError as exc:
            raise APIError(400, str(exc), param=exc.param, code="context_length_exceeded") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        if ctx.capture is not None:
            # (an adapter is replayed by its name: the snapshot pins the base model's files)
            on_adapter = ctx.model not in (None, self.model_name)
            resolved = ctx.capture.start(resolved, ctx.model if on_adapter else self.fingerprint or self.model_name)
        if ctx.gate is not None:
            capped = cap is not None and resolved.max_tokens == cap and (params.max_tokens or cap + 1) > cap
            ctx.gate.reserve(ctx, num_prompt, resolved, capped)
        ctx.usage = self.usage(num_prompt, 0, 0)
        ctx.params = resolved
        return resolved

    async def prepare_held(self, ctx: RequestContext, body, prompts: list[list[int]], params: SamplingParams
                           ) -> ResolvedParams:
        """prepare(), its model loaded and held first (hold_model); a check with no gate (a
        batch line's validation) runs nothing, so it lets the model go at once."""
        lease = await self.hold_model(ctx, body.keep_alive_seconds())
        try:
            return self.prepare(ctx, prompts, params, body.param_renames())
        finally:
            if lease is not None and ctx.gate is None:
                lease.release()

    def generate(self, ctx: RequestContext, sub_id: str, ids: list[int], params: ResolvedParams,
                 cache_salt: str | None) -> AsyncIterator[RequestOutput]:
        if ctx.capture is not None:
            ctx.capture.prompt(sub_id, ids)
        try:
            return self.engine.generate(sub_id, ids, params, model=ctx.model or self.model_name, priority=ctx.priority,
                                        cache_salt=cache_salt, tenant=ctx.tenant, deadline=ctx.deadline)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None

    @staticmethod
    def check_deadline(body: dict[str, Any]) -> dict[str, Any]:
        if any(c.get("finish_reason") == "abort" and c.get("stop_reason") == "deadline" for c in body["choices"]):
            raise APIError(504, "the request's deadline passed before it finished; its work was abandoned",
                           code="deadline_exceeded")
        return body

    # -- output side --------------------------------------------------------------------
    def record(self, ctx: RequestContext, out: RequestOutput) -> None:
        if out.finished:
            self.metrics.observe_finished(out, self.answered_by(ctx))
        if ctx.capture is not None:
            ctx.capture.observe(out)
        for observe in ctx.observers:
            observe(out)
        if ctx.trace is not None:
            ctx.trace.observe(out)

    @staticmethod
    def usage(prompt_tokens: int, cached: int, completion_tokens: int,
              spec: SpecTally | None = None, cache_writes: dict[int, int] | None = None,
              reasoning_tokens: int | None = None) -> dict[str, Any]:
        """OpenAI's usage. `cache_writes` (the request marked cache_control breakpoints): the
        prompt tokens it wrote to the cache by TTL in seconds, reported beside the reads,
        also under Anthropic's names (whose parts, like OpenAI's, are of prompt_tokens here).
        `reasoning_tokens`: of the completion tokens, those inside thinking blocks (None: the
        model does not think, and usage has no completion_tokens_details)."""
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if cache_writes is not None:
            written = sum(cache_writes.values())
            usage["prompt_tokens_details"]["cache_write_tokens"] = written
            usage["cache_read_input_tokens"] = cached
            usage["cache_creation_input_tokens"] = written
            usage["cache_creation"] = {"ephemeral_5m_input_tokens": cache_writes.get(CACHE_TTLS["5m"], 0),
                                       "ephemeral_1h_input_tokens": cache_writes.get(CACHE_TTLS["1h"], 0)}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        if spec is not None and spec.draft_tokens:
            usage["speculative"] = spec.as_dict()
        return usage

    def progress(self, ctx: RequestContext, num_prompt: int, cached: int, completion: int) -> None:
        """Keep ctx.usage current, so a request cut short is still settled for what it used."""
        ctx.usage = self.usage(num_prompt, cached, completion)

    def finish_usage(self, ctx: RequestContext, usage: dict[str, Any]) -> dict[str, Any]:
        for hook in ctx.usage_hooks:  # pricing: may add fields (usage.cost)
            hook(ctx, usage)
        ctx.usage = usage
        return usage

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))


async def run_until_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (and so aborting its engine request) if the client
    disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # deliver failures to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def streaming_response(chunks: AsyncIterator[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **(headers or {})})


async def sse_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started, a failure can only be reported in-band."""
    try:
        async for c in chunks:
            yield c
    except APIError as exc:
        yield exc.sse()
    except (EngineDeadError, ModelUnavailable) as exc:
        yield as_api_error(exc).sse()
    except InvalidParameter as exc:
        yield APIError(400, str(exc), param=exc.param).sse()
    yield "data: [DONE]\n\n"


def json_response(body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body)


def now() -> int:
    return int(time.time())
