"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from jinja2 import TemplateError
from starlette.responses import Response

from tokenmill.engine.api import CachePin, Choice, TokenLogprob
from tokenmill.server.errors import APIError
from tokenmill.server import reasoning as thinking
from tokenmill.server import tools as tool_calls
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import (BaseServing, RequestContext, SpecTally, json_response, now, per_model,
                                      run_until_disconnected, sse, sse_with_errors, streaming_response)


class ServingChat(BaseServing):
    _tag_tokens: bool | None = None  # tools.tags_are_tokens of this tokenizer, found on first use
    reasoning: thinking.ChatReasoning | None = None  # the reasoning parser (server/reasoning.py), if any

    @per_model
    async def create(self, body: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        if not body.stream:
            return json_response(await run_until_disconnected(raw, self.complete(body, ctx)))
        return streaming_response(sse_with_errors(_as_sse(await self.open_stream(body, ctx))))

    @per_model
    async def open_stream(self, body: ChatCompletionRequest, ctx: RequestContext) -> AsyncIterator[dict[str, Any]]:
        """Checked, admitted and started: the answer's chunks as dicts (what a dialect
        translates; a failure from here on is raised while they are read)."""
        ids, params = await self.prepare_body(body, ctx)
        stream = self.generate(ctx, ctx.request_id, ids, params, body.cache_salt)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return self.chunks(body, ctx, stream, len(ids), include_usage)

    @per_model
    async def complete(self, body: ChatCompletionRequest, ctx: RequestContext) -> dict[str, Any]:
        """The whole answer as one JSON body (what a batch line gets, too)."""
        return await (await self.begin(body, ctx))

    @per_model
    async def begin(self, body: ChatCompletionRequest, ctx: RequestContext) -> Awaitable[dict[str, Any]]:
        """Checked and admitted now; the whole answer, to await later (a background
        response is refused at once, and generates in its own task)."""
        ids, params = await self.prepare_body(body, ctx)
        stream = self.generate(ctx, ctx.request_id, ids, params, body.cache_salt)
        return self._whole(body, ctx, stream, len(ids))

    async def _whole(self, body: ChatCompletionRequest, ctx: RequestContext, stream, num_prompt: int) -> dict:
        return self.check_deadline(await self._full(body, ctx, stream, num_prompt))

    @per_model
    async def prepare_body(self, body: ChatCompletionRequest, ctx: RequestContext) -> tuple[list[int], Any]:
        """Everything checked and the prompt tokenized: (prompt ids, params to run). With
        no gate on ctx this is only the check (a batch line's validation)."""
        self.check_model(body.model, ctx)
        self.check_generates()
        text = await self.render_text(body)
        ids = await self.encode(text, "messages", add_special_tokens=False)
        if self._tag_tokens is None:
            self._tag_tokens = tool_calls.tags_are_tokens(self.tokenizer)
        body.for_tokenizer(self._tag_tokens)
        params = body.sampling_params()
        params.thinking_token_budget = body.thinking_token_budget  # (refused without a reasoning parser)
        if self.reasoning is not None:
            body._thinking = self.reasoning.apply(text, params, body.thinking_token_budget, body.reasoning_effort)
        if body.uses_cache_control:
            params = dataclasses.replace(params, cache_pins=await self._cache_pins(body, ids))
        return ids, await self.prepare_held(ctx, body, [ids], params)

    @per_model
    async def render(self, body: ChatCompletionRequest, add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids: messages and tools checked, rendered by the chat
        template, tokenized (the template writes its own special tokens)."""
        return await self.encode(await self.render_text(body), "messages", add_special_tokens=add_special_tokens)

    @per_model
    async def render_text(self, body: ChatCompletionRequest) -> str:
        """The prompt as the chat template renders it, messages and tools checked first."""
        self.check_model(body.model)
        bounds = self.engine.bounds
        if len(body.messages) > bounds.max_messages:
            raise APIError(400, f"at most {bounds.max_messages} messages per request, got {len(body.messages)}",
                           param="messages")
        body.tools_by_name()  # tools and tool_choice checked before anything is rendered
        kwargs = thinking.template_kwargs(body.chat_template_kwargs)
        try:
            messages, tools = self._with_tools(body, [m.as_template_dict() for m in body.messages])
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages,
                                           body.add_generation_prompt, tools=tools, **kwargs)
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"could not render the chat template: {exc}", param="messages") from None
        return text

    async def _cache_pins(self, body: ChatCompletionRequest, ids: list[int]) -> tuple[CachePin, ...]:
        """The cache_control breakpoints as token counts: each marked prefix of the messages
        rendered alone, and the run of the prompt's tokens it shares (a template may end a
        conversation differently than it continues one)."""
        pins = []
        for messages, ttl_s in body.cache_prefixes():
            try:
                msgs, tools = self._with_tools(body, messages)
                text = await asyncio.to_thread(self.tokenizer.apply_chat_template, msgs, False, tools=tools)
            except (ValueError, TemplateError) as exc:
                raise APIError(400, f"could not render the chat template: {exc}", param="messages") from None
            prefix = await self.encode(text, "messages", add_special_tokens=False)
            n = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
            if n:
                pins.append(CachePin(n, ttl_s))
        return tuple(pins)

    def _with_tools(self, body: ChatCompletionRequest, messages: list[dict[str, Any]]):
        """(messages, tools) for the template: as they are if it has a tools branch (calls'
        arguments as objects), else the tools, tool calls and tool results rendered as text
        (tokenmill/server/tools.py)."""
        tools = body.tools if body.tools_active else None
        template = self.tokenizer.chat_template
        if tool_calls.template_has_tools(template.source if template is not None else None):
            return tool_calls.template_messages(messages), tools
        return tool_calls.render_messages(messages, tools), None

    def _answer(self, body: ChatCompletionRequest, c: Choice) -> tuple[dict[str, Any], str | None]:
        """The message and finish reason of a finished choice: its thinking split off
        with a reasoning parser, then tool calls parsed out of the answer when tools were
        offered."""
        text, extra = c.text, {}
        if body._thinking is not None:
            reasoning, answer = thinking.split(self.reasoning.kind, c.text, body._thinking.inside)
            text, extra = answer or "", {"reasoning_content": reasoning}
        if body.tools_active:
            content, calls = tool_calls.parse_calls(text, body.tools_by_name())
            if calls:
                finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
                return {"role": "assistant", "content": content, **extra,
                        "tool_calls": [t.as_dict() for t in calls]}, finish
        if body._thinking is not None and not text:
            text = None  # all thinking (it never closed), as vLLM gives it
        return {"role": "assistant", "content": text, **extra}, c.finish_reason

    @staticmethod
    def _reasoning_tokens(body: ChatCompletionRequest, counts: list[int]) -> int | None:
        """usage's reasoning_tokens: with a reasoning parser, the choices' (tags included)."""
        return sum(counts) if body._thinking is not None else None

    def _logprob_entries(self, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [
            {"token": self.token_str(lp.token_id), "logprob": lp.logprob, "bytes": self.token_bytes(lp.token_id),
             "top_logprobs": [{"token": self.token_str(t), "logprob": v, "bytes": self.token_bytes(t)}
                              for t, v in lp.top]}
            for lp in lps]

    async def _full(self, body: ChatCompletionRequest, ctx: RequestContext, stream, num_prompt: int) -> dict:
        choices = {i: Choice(i) for i in range(body.n)}
        # rendered as they arrive: one step's worth at a time, not all at the end
        rendered: dict[int, list[dict[str, Any]]] = {i: [] for i in range(body.n)}
        cached = 0
        writes: dict[int, int] = {}
        spec = SpecTally()
        async for out in stream:
            self.record(ctx, out)
            spec.add(out)
            choices[out.index].add(out)
            if body.logprobs and out.logprobs:
                rendered[out.index] += self._logprob_entries(out.logprobs)
            if out.index == 0:
                cached, writes = out.num_cached_tokens, out.cache_write_tokens
            self.progress(ctx, num_prompt, cached, sum(c.num_output_tokens for c in choices.values()))
        usage = self.usage(num_prompt, cached, sum(c.num_output_tokens for c in choices.values()), spec,
                           writes if body.uses_cache_control else None,
                           self._reasoning_tokens(body, [c.num_reasoning_tokens for c in choices.values()]))
        answers = {c.index: self._answer(body, c) for c in choices.values()}
        return {
            "id": ctx.request_id, "object": "chat.completion", "created": now(), "model": self.answered_by(ctx),
            "choices": [{
                "index": c.index, "message": answers[c.index][0],
                "logprobs": {"content": rendered[c.index]} if body.logprobs else None,
                "finish_reason": answers[c.index][1], "stop_reason": c.stop_reason,
            } for c in choices.values()],
            "usage": self.finish_usage(ctx, usage),
            "system_fingerprint": self.fingerprint,
        }

    async def chunks(self, body: ChatCompletionRequest, ctx: RequestContext, stream, num_prompt: int,
                     include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        created = now()
        base = {"id": ctx.request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.answered_by(ctx), "system_fingerprint": self.fingerprint}
        if include_usage:
            base["usage"] = None

        def chunk(index: int, delta: dict, finish: str | None = None, logprobs: Any = None,
                  stop_reason: int | str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish, "stop_reason": stop_reason}]}

        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        outputs = [0] * body.n
        cached = 0
        writes: dict[int, int] = {}
        parsers = None  # with tools: one parser per choice splits content from calls
        if body.tools_active:
            parsers = [tool_calls.StreamParser(body.tools_by_name()) for _ in range(body.n)]
        thinkers = [self.reasoning.parser(body._thinking) for _ in range(body.n)] if body._thinking else None
        reasoning = [0] * body.n
        spec = SpecTally()
        async for out in stream:
            self.record(ctx, out)
            spec.add(out)
            outputs[out.index] = out.num_output_tokens
            if out.index == 0:
                cached, writes = out.num_cached_tokens, out.cache_write_tokens
            self.progress(ctx, num_prompt, cached, sum(outputs))
            lps = {"content": self._logprob_entries(out.logprobs)} if (body.logprobs and out.logprobs) else None
            reasoning[out.index] = out.num_reasoning_tokens
            piece, thought = out.text, {}  # the answer's text, and the reasoning beside it
            if thinkers is not None:
                r, piece = thinkers[out.index].step(out.text, out.finished)
                thought = {"reasoning_content": r} if r else {}
            if parsers is not None:  # tool calls are sent whole, each as its block closes
                p = parsers[out.index]
                n_before = len(p.calls)
                text, calls = p.feed(piece)
                if out.finished:
                    rest, late = p.finish()
                    text, calls = text + rest, calls + late
                delta: dict[str, Any] = {**thought, **({"content": text} if text else {})}
                if calls:
                    delta["tool_calls"] = [{"index": n_before + k, **c.as_dict()} for k, c in enumerate(calls)]
                finish = out.finish_reason if out.finished else None
                if finish == "stop" and p.calls:
                    finish = "tool_calls"
                if delta or lps or out.finished:
                    yield chunk(out.index, delta, finish, lps, out.stop_reason if out.finished else None)
            elif piece or thought or lps or out.finished:
                delta = {**thought, **({"content": piece} if piece else {})}
                yield chunk(out.index, delta, out.finish_reason if out.finished else None, lps,
                            out.stop_reason if out.finished else None)
        usage = self.finish_usage(ctx, self.usage(num_prompt, cached, sum(outputs), spec,
                                                  writes if body.uses_cache_control else None,
                                                  self._reasoning_tokens(body, reasoning)))
        if include_usage:
            yield {**base, "choices": [], "usage": usage}


async def _as_sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for c in chunks:
        yield sse(c)
