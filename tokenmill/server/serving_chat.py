"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from jinja2 import TemplateError
from starlette.responses import Response

from tokenmill.engine.api import Choice, TokenLogprob
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import (BaseServing, RequestContext, json_response, now,
                                      run_until_disconnected, sse, sse_with_errors, streaming_response)


class ServingChat(BaseServing):
    async def create(self, body: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        self.check_model(body.model)
        bounds = self.engine.bounds
        if len(body.messages) > bounds.max_messages:
            raise APIError(400, f"at most {bounds.max_messages} messages per request, got {len(body.messages)}",
                           param="messages")
        try:
            messages = [m.as_template_dict() for m in body.messages]
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages,
                                           body.add_generation_prompt, tools=body.tools)
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"could not render the chat template: {exc}", param="messages") from None
        ids = await self.encode(text, "messages", add_special_tokens=False)
        params = self.prepare(ctx, [ids], body.sampling_params(), body.param_renames())
        stream = self.generate(ctx, ctx.request_id, ids, params, body.cache_salt)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return streaming_response(sse_with_errors(self._stream(body, ctx, stream, len(ids), include_usage)))
        return json_response(self.check_deadline(
            await run_until_disconnected(raw, self._full(body, ctx, stream, len(ids)))))

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
        async for out in stream:
            self.record(out)
            choices[out.index].add(out)
            if body.logprobs and out.logprobs:
                rendered[out.index] += self._logprob_entries(out.logprobs)
            if out.index == 0:
                cached = out.num_cached_tokens
            self.progress(ctx, num_prompt, cached, sum(c.num_output_tokens for c in choices.values()))
        usage = self.usage(num_prompt, cached, sum(c.num_output_tokens for c in choices.values()))
        return {
            "id": ctx.request_id, "object": "chat.completion", "created": now(), "model": self.model_name,
            "choices": [{
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": rendered[c.index]} if body.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            } for c in choices.values()],
            "usage": self.finish_usage(ctx, usage),
            "system_fingerprint": None,
        }

    async def _stream(self, body: ChatCompletionRequest, ctx: RequestContext, stream, num_prompt: int,
                      include_usage: bool) -> AsyncIterator[str]:
        created = now()
        base = {"id": ctx.request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        if include_usage:
            base["usage"] = None

        def chunk(index: int, delta: dict, finish: str | None = None, logprobs: Any = None) -> str:
            return sse({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish}]})

        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        outputs = [0] * body.n
        cached = 0
        async for out in stream:
            self.record(out)
            outputs[out.index] = out.num_output_tokens
            if out.index == 0:
                cached = out.num_cached_tokens
            self.progress(ctx, num_prompt, cached, sum(outputs))
            lps = {"content": self._logprob_entries(out.logprobs)} if (body.logprobs and out.logprobs) else None
            if out.text or lps or out.finished:
                delta = {"content": out.text} if out.text else {}
                yield chunk(out.index, delta, out.finish_reason if out.finished else None, lps)
        usage = self.finish_usage(ctx, self.usage(num_prompt, cached, sum(outputs)))
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage})
