"""POST /tokenize and /detokenize in vLLM's shapes: a prompt (or chat messages, rendered
by the chat template exactly as /v1/chat/completions renders them) to token ids, and
token ids back to text. Nothing is generated, so nothing is admitted or priced; both are
bounded like every route (the body limit, messages per request, ids in the vocabulary)
and tokenize off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import StrictBool, StrictInt, StrictStr, ValidationError

from tokenmill.engine.api import EngineClient, ModelHost
from tokenmill.server.errors import APIError, as_api_error
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, _Body
from tokenmill.server.serving_chat import ServingChat


class TokenizeRequest(_Body):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body: exactly one
    of `prompt` and `messages`."""
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: a bare prompt gets the tokenizer's special tokens (BOS), messages
    # do not (the chat template writes its own)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def add_tokenize_routes(app: FastAPI, engine: EngineClient, chat: ServingChat) -> None:
    def max_model_len(name: str) -> int:
        served = engine.served(name)
        if served.started_limits is None and isinstance(engine, ModelHost):  # not loaded yet: as it will be
            return next(m["max_model_len"] for m in engine.model_states() if m["id"] == name)
        return served.max_model_len

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        own = chat.for_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            try:  # (the chat body's own checks: a tool message without its tool_call_id, ...)
                as_chat = ChatCompletionRequest(model=own.model_name, messages=body.messages, tools=body.tools,
                                                add_generation_prompt=body.add_generation_prompt)
            except ValidationError as exc:
                raise as_api_error(exc) from None
            ids = await own.render(as_chat, add_special_tokens=bool(body.add_special_tokens))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await own.encode(body.prompt, "prompt", add_special_tokens=add)
        strs = [own.token_str(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len(own.model_name), "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        own = chat.for_model(body.model)
        vocab = engine.served(own.model_name).config.vocab_size
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab):
            raise APIError(400, f"tokens must be in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(own.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}
