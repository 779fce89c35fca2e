"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, a
translation at the edge. A Messages body becomes the ChatCompletionRequest it stands
for and runs through the same route machinery as /v1/chat/completions (gate, limits,
pricing, telemetry, idempotency: app.py's `serve`), then the chat answer or chunk
stream is turned back into a Message or Anthropic's stream events. Errors, wherever
they arise (the front door's 401 and 413 included), leave in Anthropic's error shape
(`AnthropicEdge`, outermost)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.responses import JSONResponse, Response

from tokenmill.server.dialects.anthropic_edge import AnthropicEdge, error_body
from tokenmill.server.dialects.common import chat_request, renamed
from tokenmill.server.errors import APIError, as_api_error
from tokenmill.server.protocol import ChatCompletionRequest, _Body
from tokenmill.server.serving import RequestContext, run_until_disconnected, streaming_response
from tokenmill.server.serving_chat import ServingChat

RENAMES = {"stop": "stop_sequences", "response_format": "output_config"}  # chat's name -> ours, in a refusal


class MessageParam(_Body):
    # "system" too: Claude Code 2.1 sends system reminders as system messages mid-conversation
    role: Literal["user", "assistant", "system"]
    content: Union[StrictStr, list[dict[str, Any]]]


class ToolParam(_Body):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: StrictStr | None = None  # "custom" (or absent); Anthropic's server tools are not run here


class ToolChoiceParam(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class MetadataParam(_Body):
    user_id: StrictStr | None = None


class OutputFormatParam(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(_Body):
    format: OutputFormatParam | None = None  # `effort` is accepted and has no effect here


class CountTokensRequest(_Body):
    model: StrictStr
    messages: list[MessageParam] = Field(min_length=1)
    system: Union[StrictStr, list[dict[str, Any]], None] = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    metadata: MetadataParam | None = None
    output_config: OutputConfigParam | None = None


# -- request: Messages -> chat ------------------------------------------------------------
def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (a system prompt, a tool result)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise APIError(400, f"{where}.{j}: only text blocks are supported here (this model reads text)",
                           param=where)
        texts.append(b["text"])
    return "\n".join(texts)


def _field(block: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = block.get(name)
    if not isinstance(value, kind):
        raise APIError(400, f"{where}.{name} must be a {kind.__name__}", param="messages")
    return value


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: a tool_use block is an assistant tool call, a
    tool_result block a tool message (in the order the blocks come)."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_field(block, "text", str, where))
            elif kind == "tool_use" and m.role == "assistant":
                args = block.get("input", {})
                if not isinstance(args, dict):
                    raise APIError(400, f"{where}.input must be an object", param="messages")
                calls.append({"id": _field(block, "id", str, where), "type": "function", "function": {
                    "name": _field(block, "name", str, where), "arguments": json.dumps(args)}})
            elif kind == "tool_result" and m.role == "user":
                if texts:  # what came before the result stays before it
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                result = _text_of(block.get("content", ""), f"{where}.content")
                if block.get("is_error") is True:
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, where),
                            "content": result})
            elif kind in ("thinking", "redacted_thinking"):
                continue  # an earlier turn's reasoning: this model neither writes nor reads it
            else:
                raise APIError(400, f"{where}: a {m.role} message cannot hold a block of type {kind!r} here "
                                    "(this model reads text, tool_use and tool_result blocks)", param="messages")
        if texts or calls or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    if body.messages[-1].role == "assistant":
        raise APIError(400, "the last message must be the user's (a prefilled assistant turn is not supported)",
                       param="messages")
    return out


def _tools(body: CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """(chat tools, chat tool_choice, parallel_tool_calls)."""
    tools = None
    if body.tools:
        for i, t in enumerate(body.tools):
            if t.type not in (None, "custom"):
                raise APIError(400, f"tools.{i}: tools of type {t.type!r} are not supported (client tools only)",
                               param="tools")
        tools = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in body.tools]
    tc = body.tool_choice
    if tc is None:
        return tools, None, None
    if tc.type == "tool" and tc.name is None:
        raise APIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice")
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or {
        "type": "function", "function": {"name": tc.name}}
    return tools, choice, False if tc.disable_parallel_tool_use else None


def to_chat(body: CountTokensRequest, model: str) -> ChatCompletionRequest:
    tools, tool_choice, parallel = _tools(body)
    fields: dict[str, Any] = {"model": model, "messages": chat_messages(body), "tools": tools,
                              "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      user=body.metadata.user_id if body.metadata else None)
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
        if body.output_config is not None and body.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.schema_}}
    return chat_request(fields, RENAMES)


# -- answer: chat -> Messages -------------------------------------------------------------
def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic counts cached input apart: input_tokens + cache_read_input_tokens (+
    cache_creation_input_tokens, none here: the prefix cache fills itself for free) is the
    whole prompt, what count_tokens reports."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    out = {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
           "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
    if "cost" in chat_usage:
        out["cost"] = chat_usage["cost"]
    return out


def stop_reason(finish: str | None, matched: Any, stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason and the stop that matched."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in (stops or []):
        return "stop_sequence", matched
    return "end_turn", None


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:  # a call's arguments are parsed JSON; this is only a guard
        return {}


def to_message(answer: dict[str, Any], body: MessagesRequest) -> dict[str, Any]:
    choice = answer["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), body.stop_sequences)
    return {"id": answer["id"], "type": "message", "role": "assistant", "model": body.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(answer["usage"])}


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"


async def stream_events(chunks: AsyncIterator[dict[str, Any]], body: MessagesRequest,
                        ctx: RequestContext) -> AsyncIterator[str]:
    """The chat chunks as Anthropic's events. message_start waits for the first output,
    when the prompt's cached tokens are known (its usage is then exact); text is one text
    block, each tool call one tool_use block (its arguments one input_json_delta: calls
    arrive whole)."""
    started = False
    index = -1
    text_open = False  # a text block is being written
    finish = matched = None
    final_usage = None

    def start() -> str:
        nonlocal started
        started = True
        u = usage(ctx.usage) if ctx.usage else {"input_tokens": 0, "output_tokens": 0}
        message = {"id": ctx.request_id, "type": "message", "role": "assistant", "model": body.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**u, "output_tokens": 0}}
        return event("message_start", {"message": message}) + event("ping", {})

    def close() -> str:
        nonlocal text_open
        text_open = False
        return event("content_block_stop", {"index": index})

    try:
        first = True
        async for c in chunks:
            if first:  # the role chunk: nothing generated yet
                first = False
                continue
            if not started:
                yield start()
            if c.get("usage") and not c["choices"]:
                final_usage = c["usage"]
                continue
            ch = c["choices"][0]
            text = ch["delta"].get("content")
            if text:
                if not text_open:
                    index += 1
                    text_open = True
                    yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": text}})
            for call in ch["delta"].get("tool_calls") or []:
                if text_open:
                    yield close()
                index += 1
                fn = call["function"]
                yield event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": fn["arguments"]}})
                yield event("content_block_stop", {"index": index})
            if ch["finish_reason"] is not None:
                finish, matched = ch["finish_reason"], ch.get("stop_reason")
        if finish == "abort" and matched == "deadline":
            raise APIError(504, "the request's deadline passed before it finished; its work was abandoned",
                           code="deadline_exceeded")
        if not started:
            yield start()
        if text_open:
            yield close()
        reason, sequence = stop_reason(finish, matched, body.stop_sequences)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(final_usage or ctx.usage)})
        yield event("message_stop", {})
    except Exception as exc:  # once the stream has begun, a failure can only be told in-band
        err = as_api_error(exc)
        if err is None:
            raise
        yield event("error", {"error": error_body(err.status, err.message)["error"]})


class _Messages:
    """One request's way back: `serve` runs the chat body through `create`."""

    def __init__(self, chat: ServingChat, body: MessagesRequest):
        self.chat = chat
        self.body = body

    async def create(self, chat_body: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        try:
            if not chat_body.stream:
                answer = await run_until_disconnected(raw, self.chat.complete(chat_body, ctx))
                return JSONResponse(to_message(answer, self.body))
            chunks = await self.chat.open_stream(chat_body, ctx)
        except Exception as exc:  # a client's error, named as this dialect names the field
            err = renamed(exc, RENAMES)
            if err is exc:
                raise
            raise err from None
        return streaming_response(stream_events(chunks, self.body, ctx))


def add_messages_routes(app: FastAPI, chat: ServingChat, serve: Callable, gate: Any) -> None:
    """The routes, and the edge that speaks Anthropic's errors (added outside whatever
    middleware the app has so far: call this after the front door)."""
    app.add_middleware(AnthropicEdge, gate=gate)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        chat.check_model(body.model)
        return await serve(raw, to_chat(body, body.model), _Messages(chat, body), "msg", "chat")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """The prompt's tokens exactly as /v1/messages would render them (nothing runs)."""
        chat.check_model(body.model)
        return {"input_tokens": len(await chat.render(to_chat(body, body.model)))}
