"""Tool calls: the rendering, parsing and streaming pieces (tokenmill/server/tools.py) on
their own, then tools + tool_choice through the live server with the openai SDK."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL
from tokenmill.engine.api import InvalidParameter
from tokenmill.engine.structured.grammar import validate
from tokenmill.server import tools as T

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                  "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# -- the pieces ----------------------------------------------------------------------------
def test_parse_calls_and_content():
    by_name = T.check_tools(TOOLS, "auto")
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>')
    content, calls = T.parse_calls(text, by_name)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert len({c.id for c in calls}) == 2
    assert T.parse_calls("just text <tool_call> {broken", by_name) == ("just text <tool_call> {broken", [])


def test_stream_parser_matches_whole_parse():
    by_name = T.check_tools(TOOLS, "auto")
    text = 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        p = T.StreamParser(by_name)
        content, calls = "", []
        for i in range(0, len(text), size):
            c, new = p.feed(text[i:i + size])
            content, calls = content + c, calls + new
        content += p.finish()
        assert content.strip() == "Sure" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 5, "b": 7}')]
    p = T.StreamParser(by_name)
    assert p.feed("a < b <tool")[0] == "a < b " and p.finish() == "<tool"  # a tag prefix that never became one


def test_render_messages_puts_tools_in_the_system_prompt():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    out = T.render_messages(msgs, TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(ADD) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}


@pytest.mark.parametrize("tools,choice,param", [
    ([ADD], {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([ADD], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools"),
    ([ADD, ADD], "auto", "tools"),
    ([{"type": "retrieval"}], "auto", "tools"),
])
def test_bad_tools_name_the_parameter(tools, choice, param):
    with pytest.raises(InvalidParameter) as exc:
        T.check_tools(tools, choice)
    assert exc.value.param == param


def test_call_grammars_compile():
    by_name = T.check_tools(TOOLS, "required")
    validate(T.call_grammar(by_name, ["add"], parallel=False))
    validate(T.call_grammar(by_name, list(by_name), parallel=True))


# -- through the server --------------------------------------------------------------------
def _ask(client, content="What is the weather in Paris, in celsius?", **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          tools=TOOLS, **kw)


def _check_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_required_always_gives_a_valid_call(client, temperature, seed):
    # sampled: one call (with parallel calls allowed, a sampled 135M model may go on calling)
    r = _ask(client, tool_choice="required", temperature=temperature, seed=seed,
             parallel_tool_calls=None if seed is None else False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        _check_call(call)


def test_named_tool_is_called(client):
    r = _ask(client, "Add 2 and 40.", tool_choice={"type": "function", "function": {"name": "add"}},
             temperature=0, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    assert c.message.tool_calls[0].function.name == "add"
    _check_call(c.message.tool_calls[0])


def test_auto_without_need_gives_content(client):
    r = _ask(client, "Say hello.", tool_choice="auto", temperature=0, max_tokens=20)
    c = r.choices[0]
    if not c.message.tool_calls:  # what a 135M model writes is its business; the shape is ours
        assert c.message.content and c.finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_streamed_calls_reassemble_to_the_same_call(client):
    kwargs = dict(tool_choice="required", temperature=0)
    whole = _ask(client, **kwargs).choices[0].message.tool_calls
    with client.chat.completions.stream(model=MODEL, tools=TOOLS, max_tokens=80, messages=[
            {"role": "user", "content": "What is the weather in Paris, in celsius?"}], **kwargs) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_round_trip(client):
    messages = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=30, temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400(client, extra, param):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       extra_body=extra)
    assert exc.value.body["param"] == param, exc.value.body
