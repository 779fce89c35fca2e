"""POST /v1/completions (the legacy text API: prompt in, text out, echo, logprobs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from tokenmill.engine.api import Choice, RequestOutput, TokenLogprob
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving import (BaseServing, RequestContext, SpecTally, json_response, merge_streams, now,
                                      per_model, run_until_disconnected, sse, sse_with_errors, streaming_response)


class ServingCompletion(BaseServing):
    async def _prompts(self, prompt: Any) -> list[tuple[str, list[int]]]:
        """(text, ids) for each prompt the body holds; the text of a token-id prompt only
        when echo needs it (and only once its ids are known to be in the vocabulary)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        limit = self.engine.bounds.max_prompts
        if len(prompt) > limit:
            raise APIError(400, f"at most {limit} prompts per request, got {len(prompt)}", param="prompt")
        if isinstance(prompt[0], str):
            return [(p, await self.encode(p, "prompt")) for p in prompt]
        if isinstance(prompt[0], int):
            prompt = [prompt]
        return [("", list(ids)) for ids in prompt]

    @per_model
    async def create(self, body: CompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        if not body.stream:
            return json_response(await run_until_disconnected(raw, self.complete(body, ctx)))
        prompts, streams = await self._start(body, ctx)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return streaming_response(sse_with_errors(self._stream(body, ctx, prompts, streams, include_usage)))

    @per_model
    async def complete(self, body: CompletionRequest, ctx: RequestContext) -> dict[str, Any]:
        """The whole answer as one JSON body (what a batch line gets, too)."""
        prompts, streams = await self._start(body, ctx)
        return self.check_deadline(await self._full(body, ctx, prompts, streams))

    @per_model
    async def prepare_body(self, body: CompletionRequest, ctx: RequestContext):
        """Everything checked and the prompts tokenized: ([(text, ids)], params to run).
        With no gate on ctx this is only the check (a batch line's validation)."""
        self.check_model(body.model, ctx)
        if body.suffix:
            raise APIError(400, "suffix is not supported by this model", param="suffix")
        prompts = await self._prompts(body.prompt)
        return prompts, await self.prepare_held(ctx, body, [ids for _, ids in prompts], body.sampling_params())

    async def _start(self, body: CompletionRequest, ctx: RequestContext):
        prompts, params = await self.prepare_body(body, ctx)
        if body.echo and not isinstance(body.prompt, str) and not isinstance(body.prompt[0], str):
            prompts = [(await asyncio.to_thread(self.tokenizer.decode, ids, skip_special_tokens=False), ids)
                       for _, ids in prompts]
        streams = [self.generate(ctx, ctx.request_id if len(prompts) == 1 else f"{ctx.request_id}-{p}", ids,
                                 params, body.cache_salt)
                   for p, (_, ids) in enumerate(prompts)]
        return prompts, streams

    # -- logprobs in the legacy shape ---------------------------------------------------
    def _logprobs(self, lps: list[TokenLogprob], start_offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = start_offset
        for lp in lps:
            s = self.token_str(lp.token_id)
            tokens.append(s)
            token_lps.append(lp.logprob)
            tops.append({self.token_str(t): v for t, v in lp.top} if lp.top else None)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _echo_logprobs(out: RequestOutput, ids: list[int]) -> list[TokenLogprob]:
        """Prompt tokens' logprobs; the first token has none (null, as OpenAI sends it)."""
        plp = out.prompt_logprobs or []
        return [TokenLogprob(ids[0], None, [])] + [lp for lp in plp[1:] if lp is not None]

    async def _full(self, body: CompletionRequest, ctx: RequestContext, prompts, streams) -> dict:
        n = body.n
        choices = {p * n + i: Choice(p * n + i) for p in range(len(prompts)) for i in range(n)}
        cached_by_prompt: dict[int, int] = {}  # each update repeats its prompt's figure
        cached = completion = 0  # running totals: no loop over the choices per output
        num_prompt = sum(len(ids) for _, ids in prompts)
        spec = SpecTally()
        async for p, out in merge_streams(streams):
            self.record(ctx, out)
            spec.add(out, p)
            c = choices[p * n + out.index]
            if not c.text and not c.token_ids and body.echo:
                c.text = prompts[p][0]
                if body.logprobs is not None:  # the prompt's logprobs come first
                    c.logprobs = self._echo_logprobs(out, prompts[p][1])
            completion += out.num_output_tokens - c.num_output_tokens
            c.add(out)
            if out.index == 0:
                cached += out.num_cached_tokens - cached_by_prompt.get(p, 0)
                cached_by_prompt[p] = out.num_cached_tokens
            self.progress(ctx, num_prompt, cached, completion)
        usage = self.usage(num_prompt, cached, completion, spec)
        rendered = {}
        if body.logprobs is not None:  # a whole prompt's worth with echo: off the event loop
            rendered = await asyncio.to_thread(lambda: {k: self._logprobs(c.logprobs, 0) for k, c in choices.items()})
        return {
            "id": ctx.request_id, "object": "text_completion", "created": now(), "model": self.answered_by(ctx),
            "choices": [{
                "index": c.index, "text": c.text,
                "logprobs": rendered.get(c.index),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if body.return_token_ids else {}),
            } for c in choices.values()],
            "usage": self.finish_usage(ctx, usage),
            "system_fingerprint": self.fingerprint,
        }

    async def _stream(self, body: CompletionRequest, ctx: RequestContext, prompts, streams,
                      include_usage: bool) -> AsyncIterator[str]:
        n = body.n
        base = {"id": ctx.request_id, "object": "text_completion", "created": now(), "model": self.answered_by(ctx),
                "system_fingerprint": self.fingerprint}
        if include_usage:
            base["usage"] = None
        started: set[int] = set()
        num_prompt = sum(len(ids) for _, ids in prompts)
        offsets: dict[int, int] = {}
        outputs: dict[int, int] = {}
        cached_by_prompt: dict[int, int] = {}  # each update repeats its prompt's figure
        cached = completion = 0  # running totals: no loop over the choices per output
        spec = SpecTally()
        async for p, out in merge_streams(streams):
            self.record(ctx, out)
            spec.add(out, p)
            index = p * n + out.index
            text = out.text
            lps: list = list(out.logprobs or [])
            if index not in started:
                started.add(index)
                if body.echo:
                    text = prompts[p][0] + text
                    if body.logprobs is not None:
                        lps = self._echo_logprobs(out, prompts[p][1]) + lps
            completion += out.num_output_tokens - outputs.get(index, 0)
            outputs[index] = out.num_output_tokens
            if out.index == 0:
                cached += out.num_cached_tokens - cached_by_prompt.get(p, 0)
                cached_by_prompt[p] = out.num_cached_tokens
            self.progress(ctx, num_prompt, cached, completion)
            if text or out.finished or lps:
                logprobs = None
                if body.logprobs is not None:
                    if len(lps) > 64:  # an echoed prompt's worth: off the event loop
                        logprobs = await asyncio.to_thread(self._logprobs, lps, offsets.get(index, 0))
                    else:
                        logprobs = self._logprobs(lps, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(text)
                yield sse({**base, "choices": [{
                    "index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": out.finish_reason if out.finished else None}]})
        usage = self.finish_usage(ctx, self.usage(num_prompt, cached, completion, spec))
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage})
