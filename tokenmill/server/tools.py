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
messages as they are, except that an earlier call's `arguments` string is given as the
object it encodes (the templates write it with `tojson`).

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
import math
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.api import InvalidParameter, StructuredOutput
from tokenmill.server.strict import function_parameters

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


def call_grammar(by_name: dict[str, dict[str, Any]], names: list[str], parallel: bool,
                 tag_tokens: bool = False) -> StructuredOutput:
    """A Lark grammar: one `<tool_call>` block (several with `parallel`) whose JSON is
    {"name": one of names, "arguments": that function's parameters}. `tag_tokens`: the
    vocabulary has the tags as tokens of their own (Qwen2.5's), which the grammar must
    name as tokens: llguidance takes such added tokens as special, and a special token
    never matches a literal string (see `tags_are_tokens`)."""
    branches = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": n}, "arguments": function_parameters(by_name[n])}}
                for n in names]
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    open_, close = (CALL_OPEN, CALL_CLOSE) if tag_tokens else (f'"{CALL_OPEN}"', f'"{CALL_CLOSE}"')
    call = f'{open_} "\\n" %json {json.dumps(schema)} "\\n" {close}'
    start = "start: call (\"\\n\" call)*" if parallel and len(names) else "start: call"
    return StructuredOutput("grammar", f"{start}\ncall: {call}\n")


def tags_are_tokens(tokenizer: Any) -> bool:
    """Whether `<tool_call>` and `</tool_call>` are each one added token of this
    tokenizer (Qwen2.5: ids 151657 and 151658), rather than spelled in pieces."""
    added = tokenizer.hf.get_added_tokens_decoder()
    for tag in (CALL_OPEN, CALL_CLOSE):
        tid = tokenizer.hf.token_to_id(tag)
        # a special one would be dropped from the decoded text, and the call with it
        if tid is None or tid not in added or added[tid].special:
            return False
    return True


def template_has_tools(template_source: str | None) -> bool:
    return bool(template_source) and "tools" in template_source


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with a tools branch: each earlier call's `arguments`, a
    JSON string in the OpenAI API, as the object it encodes. Templates write it with
    `| tojson` (Qwen2.5's, Hermes-style ones, as transformers renders them); the string
    itself would reach the model encoded twice, a quoted string where it wrote an object."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict) and "arguments" in fn:
                    tc = {**tc, "function": {**fn, "arguments": _arguments_object(fn["arguments"])}}
                calls.append(tc)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _arguments_object(args: Any) -> Any:
    """A call's arguments as the value their JSON string encodes (an object, from any
    client that follows the API); a string that is not JSON as it came (a client's
    malformed history is shown to the model as written)."""
    if not isinstance(args, str):
        return args
    try:
        return json.loads(args)
    except ValueError:
        return args


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
                args = _arguments_object(fn.get("arguments", "{}"))
                blocks.append(f"{CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n"
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
    the first block is the content. With no such block, a reply that ends in a bare call
    (see `bare_calls`) is one. With neither, the whole text is content."""
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
        # a reply with a tag in it is a tagged reply, well formed or not (a stream stops
        # looking for bare calls at its first tag)
        start = _bare_start(text) if CALL_OPEN not in text else None
        calls = bare_calls(text[start:], by_name) if start is not None else []
        if not calls:
            return text, []
        first = start
    content = text[:first].strip()
    return content or None, calls


FENCE = "```"
JSON_FENCES = ("", "json")  # a code fence's info words that may hold a call


def _opens_json(text: str) -> bool:
    return text.lstrip()[:1] in ("{", "[")


def _bare_start(text: str) -> int | None:
    """Where a bare call could begin: the reply's first character when that opens a JSON
    object or array, else its first code fence."""
    if _opens_json(text):
        return len(text) - len(text.lstrip())
    i = text.find(FENCE)
    return i if i >= 0 else None


def bare_calls(text: str, by_name: dict[str, dict[str, Any]]) -> list[ToolCall]:
    """Calls written without the tags: the text is one JSON call object (or an array of
    them), alone or as the only thing in a code fence (```json ... ```). Models that
    were not trained on the tags answer so (Qwen2.5-Coder writes a fenced JSON call for
    a tool it wants); llama.cpp's Hermes parser accepts the same. All or nothing: one
    element that is not a call of a known tool and the text stays content."""
    body = text.strip()
    if body.startswith(FENCE):
        if not body.endswith(FENCE) or len(body) < 2 * len(FENCE):
            return []
        body = body[len(FENCE):-len(FENCE)]
        newline = body.find("\n")
        if newline < 0 or body[:newline].strip() not in JSON_FENCES:
            return []
        body = body[newline + 1:]
    try:
        return _calls_of(_STRICT.decode(body), by_name)
    except ValueError:
        return []


def _calls_of(obj: Any, by_name: dict[str, dict[str, Any]]) -> list[ToolCall]:
    """A JSON value's calls: one call object or a non-empty array of them, all or nothing."""
    calls = [_call_from(o, by_name) for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(c is not None for c in calls) else []


def _one_call(body: str, by_name: dict[str, dict[str, Any]]) -> ToolCall | None:
    try:
        obj = _STRICT.decode(body)
    except ValueError:
        return None
    return _call_from(obj, by_name)


def _finite(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise ValueError(f"{text} is out of a double's range")
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# JSON as RFC 8259 has it. Python's loader also takes NaN and Infinity, and reads a number
# past a double's range (a model's `26e770`: a hex id taken for a number) as infinity,
# which json.dumps then writes as `Infinity`: arguments no client can parse (Codex CLI:
# "failed to parse function arguments"). A reply holding such values is not a call.
_STRICT = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


def _call_from(obj: Any, by_name: dict[str, dict[str, Any]]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in by_name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class StreamParser:
    """Splits a stream of text deltas into content deltas and completed tool calls.
    Content is released as it comes, except text that could still be the start of a
    `<tool_call>` tag; from the first tag on, text is held until its block closes. The
    reply's one candidate for a bare call (`parse_calls`: the reply itself when it opens
    with a JSON object or array, else its first code fence on) is held while it can still
    be one, and released as content as soon as it cannot (a fence in another language,
    text after the JSON or the closing fence, JSON that is not a call): so a code answer
    still streams, and a stream finds the same calls as the whole answer."""

    def __init__(self, by_name: dict[str, dict[str, Any]]):
        self.by_name = by_name
        self.buf = ""
        self.in_calls = False  # a tag was seen: no more content is streamed
        self.held: str | None = None  # "json" or "fence": the bare-call candidate being held
        self.settled = False  # the candidate was seen and is not a call: stream freely
        self.sent = False  # some content went out (a JSON opening then is not the reply's first)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        self.buf += text
        if not self.in_calls:
            i = self.buf.find(CALL_OPEN)
            if i < 0:
                return self._content(), []
            content, self.buf = self.buf[:i], self.buf[i:]
            self.in_calls = True
        else:
            content = ""
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

    def _content(self) -> str:
        """What of the buffer (no tag in it) can go out now."""
        if self.held is None and not self.settled:
            if not self.sent and _opens_json(self.buf):
                self.held = "json"
            else:
                fence = self.buf.find(FENCE)
                if fence >= 0:
                    out, self.buf, self.held = self.buf[:fence], self.buf[fence:], "fence"
                    self.sent = self.sent or bool(out.strip())
                    return out
        if self.held is not None:
            if self._may_be_a_call():
                return ""
            self.held, self.settled = None, True
        keep = _partial_len(self.buf, CALL_OPEN)
        if not self.settled:
            keep = max(keep, _partial_len(self.buf, FENCE))
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        self.sent = self.sent or bool(out.strip())
        return out

    def _may_be_a_call(self) -> bool:
        """Whether the held candidate can still end as a bare call."""
        body = self.buf.lstrip()
        if self.held == "fence":
            newline = body.find("\n", len(FENCE))
            if newline < 0:
                return True
            if body[len(FENCE):newline].strip() not in JSON_FENCES:
                return False
            close = body.find(FENCE, newline)
            return close < 0 or not body[close + len(FENCE):].strip()
        if not body.rstrip().endswith(("}", "]")):  # only a closing bracket can end the JSON
            return True
        try:
            obj, end = _STRICT.raw_decode(body)
        except ValueError:
            return True  # unfinished (or broken: the end decides)
        return not body[end:].strip() and bool(_calls_of(obj, self.by_name))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(what is left as content, calls found only now) at the end: a held bare call,
        or a tag prefix, or an unfinished block when no call was made, as content."""
        rest, self.buf = self.buf, ""
        if self.held is not None and not self.in_calls:
            late = bare_calls(rest, self.by_name)
            if late:
                self.calls += late
                return "", late
        return ("" if self.calls else rest), []


def _partial_len(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
