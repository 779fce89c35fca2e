"""OpenAI's Responses API, the translation both ways: a /v1/responses body (its input
items, after a stored conversation) to the ChatCompletionRequest it stands for, and a
chat answer to the Response object and its output items. The routes are in
responses_routes.py, the stream in responses_stream.py."""

from __future__ import annotations

import uuid
from typing import Any, Literal, Union

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tokenmill.server.dialects.common import chat_request
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest, _Body

# chat's names -> ours, in a refusal
RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text"}


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: StrictStr
    input: Union[StrictStr, list[dict[str, Any]]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool = False
    store: StrictBool = True
    background: StrictBool = False
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request: items -> chat ---------------------------------------------------------------
def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return body.input


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.{j}: content parts of type {kind!r} are not supported "
                                "(this model reads text)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _str(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{name} must be a string", param="input")
    return value


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive function calls join the assistant turn before
    them; a call's output is a tool message. Reasoning items are skipped."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function", "function": {
                "name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                        "content": _content_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # this model neither writes nor reads reasoning items
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported (messages, function_call, "
                                "function_call_output)", param="input")
    return out


def _tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """(chat tools, chat tool_choice): function tools only."""
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise APIError(400, f"tools.{i}: only function tools ({{'type': 'function', 'name': ...}}) are "
                                    "supported", param="tools")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a schema", param="text")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def to_chat(body: ResponsesRequest, conversation: list[dict[str, Any]], stream: bool) -> ChatCompletionRequest:
    messages = chat_messages(conversation)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    tools, tool_choice = _tools(body)
    fields = {"model": body.model, "messages": messages, "tools": tools, "tool_choice": tool_choice,
              "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
              "response_format": _response_format(body), "stream": stream}
    if stream:
        fields["stream_options"] = {"include_usage": True}
    return chat_request(fields, RENAMES)


# -- answer: chat -> Response -------------------------------------------------------------
def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    out = {"input_tokens": chat_usage["prompt_tokens"],
           "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
           "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": chat_usage["total_tokens"]}
    if "cost" in chat_usage:
        out["cost"] = chat_usage["cost"]
    return out


def message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": item_id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def finish_status(finish: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) for a chat finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(answer: dict[str, Any]) -> list[dict[str, Any]]:
    choice = answer["choices"][0]
    msg = choice["message"]
    status = finish_status(choice["finish_reason"])[0]
    items = []
    if msg.get("content") or not msg.get("tool_calls"):
        items.append(message_item(item_id("msg"), msg.get("content") or "", status))
    items += [call_item(c) for c in msg.get("tool_calls") or []]
    return items


def response_object(rid: str, body: ResponsesRequest, created_at: int, status: str, *, stored: bool,
                    output: list[dict[str, Any]] | None = None, chat_usage: dict[str, Any] | None = None,
                    incomplete: dict[str, str] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object, echoing the request's settings as OpenAI does."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
        "type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status,
        "background": body.background, "error": error, "incomplete_details": incomplete,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "model": body.model, "output": output or [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": stored, "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt}, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": usage(chat_usage) if chat_usage is not None else None, "user": body.user,
    }
