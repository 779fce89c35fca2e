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
            name = _str(item, "name", where)
            if item.get("namespace") is not None:
                name = flat_name(_str(item, "namespace", where), name)
            call = {"id": _str(item, "call_id", where), "type": "function", "function": {
                "name": name, "arguments": _str(item, "arguments", where)}}
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


# Tools the Responses API runs on OpenAI's side: a local model can run none of them, so a
# client's request (Codex CLI sends web_search by default) is served without them, not refused.
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                          "code_interpreter", "computer", "computer_use_preview", "image_generation", "mcp",
                          "tool_search"})


def flat_name(namespace: str, name: str) -> str:
    """The one name a namespace's function goes by in the chat prompt (chat tools have no
    namespaces): `mcp__server__` + `status` as the client shows it, else joined by `__`."""
    return namespace + name if namespace.endswith("_") else f"{namespace}__{name}"


def _function(t: Any, where: str) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise APIError(400, f"{where}: expected a function tool ({{'type': 'function', 'name': ...}})",
                       param="tools")
    return t


def namespaces(body: ResponsesRequest) -> dict[str, tuple[str, str]]:
    """flat name -> (namespace, name) for every function inside a `namespace` tool."""
    out = {}
    for t in body.tools or []:
        if isinstance(t, dict) and t.get("type") == "namespace" and isinstance(t.get("name"), str):
            for f in t.get("tools") or []:
                if isinstance(f, dict) and isinstance(f.get("name"), str):
                    out[flat_name(t["name"], f["name"])] = (t["name"], f["name"])
    return out


def _tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """(chat tools, chat tool_choice): function tools, and the functions of namespace tools
    under their flat names; hosted tools left out."""
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            kind = t.get("type")
            if kind in HOSTED_TOOLS:
                continue
            if kind == "namespace":
                if not isinstance(t.get("name"), str) or not isinstance(t.get("tools"), list):
                    raise APIError(400, f"tools.{i}: a namespace tool has a name and a list of tools", param="tools")
                members = [(flat_name(t["name"], f["name"]), f)
                           for f in (_function(f, f"tools.{i}.tools.{j}") for j, f in enumerate(t["tools"]))]
            else:
                if kind != "function" or not isinstance(t.get("name"), str):
                    raise APIError(400, f"tools.{i}: tools of type {kind!r} are not supported (function and "
                                        f"namespace tools run here; hosted ones, {', '.join(sorted(HOSTED_TOOLS))}, "
                                        "are left out)", param="tools")
                members = [(t["name"], t)]
            for name, f in members:
                fn = {"name": name, **{k: f[k] for k in ("description", "parameters") if f.get(k) is not None}}
                tools.append({"type": "function", "function": fn})
        tools = tools or None
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'name': ...}", param="tool_choice")
        name = choice["name"]
        if isinstance(choice.get("namespace"), str):
            name = flat_name(choice["namespace"], name)
        choice = {"type": "function", "function": {"name": name}}
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


def call_item(call: dict[str, Any], spaces: dict[str, tuple[str, str]] | None = None,
              status: str = "completed") -> dict[str, Any]:
    """A function_call item; a namespace's function named as the API names it: `name` and
    `namespace` apart (Codex routes a call by both)."""
    fn = call["function"]
    item = {"type": "function_call", "id": item_id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}
    if spaces and fn["name"] in spaces:
        item["namespace"], item["name"] = spaces[fn["name"]]
    return item


def finish_status(finish: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) for a chat finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(answer: dict[str, Any], spaces: dict[str, tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    choice = answer["choices"][0]
    msg = choice["message"]
    status = finish_status(choice["finish_reason"])[0]
    items = []
    if msg.get("content") or not msg.get("tool_calls"):
        items.append(message_item(item_id("msg"), msg.get("content") or "", status))
    items += [call_item(c, spaces) for c in msg.get("tool_calls") or []]
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
