"""Tool calls: tools and tool messages rendered into the prompt, tool_choice turned into
an output constraint, and the model's text parsed back into `tool_calls`.

Text in, `tool_calls` out; the engine only ever sees a grammar (`StructuredOutput`).

## The format (for chat templates without a tools branch, such as SmolLM2's)

The tools go at the end of the system message (one is added when the conversation
has none):

    # Tools

    You may call one or more functions to assist with the user query.
    Function signatures, one JSON object per line:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
    </tools>

    To call a function, reply with one JSON object per call, each inside its own
    <tool_call></tool_call> tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

An earlier assistant turn's `tool_calls` are rendered the same way (after its
content, if any), and a `role: "tool"` message becomes a user turn holding
`<tool_response>\\n{content}\\n</tool_response>` (its tool_call_id is not shown). A
template that has a tools branch (it mentions `tools`) gets the tools and the
messages as they are.

## tool_choice

- `none`: the tools are not rendered; the model answers in text.
- `auto` (the default with tools): the model is free; whatever `<tool_call>` blocks
  it writes become `tool_calls` (finish_reason "tool_calls") and the text before the
  first one is the content.
- `required`: the output is constrained to one call (or several, one per block, with
  `parallel_tool_calls`) of any of the tools, whose arguments match its `parameters`.
- `{"type": "function", "function": {"name": N}}`: one call of N, constrained the same.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.api import InvalidParameter, StructuredOutput

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n"
           "Function signatures, one JSON object per line:\n<tools>\n")
_FOOTER = ("</tools>\n\nTo call a function, reply with one JSON object per call, each inside its own "
           "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
           "<args-json-object>}\n</tool_call>")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# -- the request side ---------------------------------------------------------------------
def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> dict[str, dict[str, Any]]:
    """The tools by name, checked; raises InvalidParameter naming `tools` or `tool_choice`."""
    by_name: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidParameter("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParameter("tools", f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidParameter("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        if name in by_name:
            raise InvalidParameter("tools", f"two tools are named {name!r}")
        by_name[name] = fn
    if tool_choice is None or tool_choice in ("none", "auto"):
        return by_name
    if tool_choice == "required":
        if not by_name:
            raise InvalidParameter("tool_choice", "tool_choice 'required' needs tools")
        return by_name
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
    if not isinstance(name, str):
        raise InvalidParameter("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                              "{'type': 'function', 'function': {'name': ...}}")
    if name not in by_name:
        raise InvalidParameter("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
    return by_name


def forced_names(by_name: dict[str, dict[str, Any]], tool_choice: Any) -> list[str] | None:
    """The functions the output must call (required: any; named: that one); None: free."""
    if tool_choice == "required":
        return list(by_name)
    if isinstance(tool_choice, dict):
        return [tool_choice["function"]["name"]]
    return None


def call_grammar(by_name: dict[str, dict[str, Any]], names: list[str], parallel: bool) -> StructuredOutput:
    """A Lark grammar: one `<tool_call>` block (several with `parallel`) whose JSON is
    {"name": one of names, "arguments": that function's parameters}."""
    branches = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": n},
                                "arguments": by_name[n].get("parameters") or {"type": "object"}}}
                for n in names]
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    call = f'"{CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"'
    start = "start: call (\"\\n\" call)*" if parallel and len(names) else "start: call"
    return StructuredOutput("grammar", f"{start}\ncall: {call}\n")


def template_has_tools(template_source: str | None) -> bool:
    return bool(template_source) and "tools" in template_source


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template without a tools branch: the tools in the system message,
    tool calls and tool results as text (the format above)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = [m["content"]] if m.get("content") else []
            for tc in m["tool_calls"]:
                fn = tc.get("function") or {}
                args = fn.get("arguments", "{}")
                try:
                    args_obj = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    args_obj = args
                blocks.append(f"{CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args_obj})}\n"
                              f"{CALL_CLOSE}")
            out.append({"role": "assistant", "content": "\n".join(blocks)})
        elif role in ("tool", "function"):
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        section = _HEADER + "".join(json.dumps(t) + "\n" for t in tools) + _FOOTER
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + section).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


# -- the response side ---------------------------------------------------------------------
def parse_calls(text: str, by_name: dict[str, dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from what the model wrote: every complete `<tool_call>` block
    holding {"name": a known tool, "arguments": an object} is a call; the text before
    the first block is the content. With no valid block, the whole text is content."""
    calls: list[ToolCall] = []
    first = None
    pos = 0
    while True:
        i = text.find(CALL_OPEN, pos)
        if i < 0:
            break
        j = text.find(CALL_CLOSE, i)
        if j < 0:
            break
        call = _one_call(text[i + len(CALL_OPEN):j], by_name)
        if call is not None:
            calls.append(call)
            first = i if first is None else first
        pos = j + len(CALL_CLOSE)
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def _one_call(body: str, by_name: dict[str, dict[str, Any]]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in by_name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class StreamParser:
    """Splits a stream of text deltas into content deltas and completed tool calls.
    Content is released as it comes, except text that could still be the start of a
    `<tool_call>` tag; from the first tag on, text is held until its block closes."""

    def __init__(self, by_name: dict[str, dict[str, Any]]):
        self.by_name = by_name
        self.buf = ""
        self.in_calls = False  # a tag was seen: no more content is streamed
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        self.buf += text
        content = ""
        if not self.in_calls:
            i = self.buf.find(CALL_OPEN)
            if i < 0:
                keep = _partial_tag_len(self.buf)
                content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return content, []
            content, self.buf = self.buf[:i], self.buf[i:]
            self.in_calls = True
        new: list[ToolCall] = []
        while True:
            i = self.buf.find(CALL_OPEN)
            j = self.buf.find(CALL_CLOSE, max(i, 0))
            if i < 0 or j < 0:
                break
            call = _one_call(self.buf[i + len(CALL_OPEN):j], self.by_name)
            if call is not None:
                new.append(call)
            self.buf = self.buf[j + len(CALL_CLOSE):]
        self.calls += new
        return content, new

    def finish(self) -> str:
        """What is left as content at the end (a tag prefix, or an unfinished block when
        no call was made)."""
        rest, self.buf = self.buf, ""
        return "" if self.calls else rest


def _partial_tag_len(text: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of CALL_OPEN."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
