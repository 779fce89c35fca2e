"""POST /tokenize and /detokenize in vLLM's shapes: a prompt (or chat messages, rendered
by the chat template exactly as /v1/chat/completions renders them) to token ids, and
token ids back to text. Nothing is generated, so nothing is admitted or priced; both are
bounded like every route (the body limit, messages per request, ids in the vocabulary)
and tokenize off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import StrictBool, StrictInt, StrictStr

from tokenmill.engine.api import EngineClient, InvalidParameter
from tokenmill.server.errors import APIError
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
    model_name = chat.model_name

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            chat.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            as_chat = ChatCompletionRequest(model=model_name, messages=body.messages, tools=body.tools,
                                            add_generation_prompt=body.add_generation_prompt)
            ids = await chat.render(as_chat, add_special_tokens=bool(body.add_special_tokens))
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await chat.encode(body.prompt, "prompt", add_special_tokens=add)
        strs = [chat.token_str(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.served().max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            chat.check_model(body.model)
        if body.tokens:
            try:
                engine.served().limits.check_token_ids(body.tokens)
            except InvalidParameter as exc:
                raise APIError(400, str(exc).replace("prompt token ids", "tokens", 1), param="tokens") from None
        text = await asyncio.to_thread(chat.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}
