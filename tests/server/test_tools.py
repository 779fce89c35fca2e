"""Tool calls: the rendering, parsing and streaming pieces (tokenmill/server/tools.py) on
their own, then tools + tool_choice through the live server with the openai SDK."""

from __future__ import annotations

import json
import os

import pytest

from tests.server.conftest import MODEL, ServerProcess
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


def _stream(text, by_name, size):
    p = T.StreamParser(by_name)
    parts, calls = [], []
    for i in range(0, len(text), size):
        c, new = p.feed(text[i:i + size])
        parts.append(c)
        calls += new
    rest, late = p.finish()
    return parts, rest, calls + late


def test_stream_parser_matches_whole_parse():
    by_name = T.check_tools(TOOLS, "auto")
    text = 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        parts, rest, calls = _stream(text, by_name, size)
        content = "".join(parts) + rest
        assert content.strip() == "Sure" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 5, "b": 7}')]
    p = T.StreamParser(by_name)
    assert p.feed("a < b <tool")[0] == "a < b " and p.finish() == ("<tool", [])  # a tag prefix, never a tag


BARE = [  # what models without the tags write (Qwen2.5-Coder: a fenced JSON call), and near misses
    ('```json\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n```', None, [("add", {"a": 1, "b": 2})]),
    ('I will add them.\n```\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```\n', "I will add them.",
     [("add", {"a": 1, "b": 2})]),
    (' {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}', None,
     [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]', None,
     [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ('{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),  # not a tool
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, 3]', '[{"name": "add", "arguments": {"a": 1, "b": 2}}, 3]', []),
    ('{"a": 1}', '{"a": 1}', []),
    ('Use this:\n```python\nadd(1, 2)\n```', 'Use this:\n```python\nadd(1, 2)\n```', []),
    ('```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```\nand more', None, []),  # not only the fence
    ('Plain answer, no JSON.', 'Plain answer, no JSON.', []),
    # not JSON (Python's loader takes them; 26e770 would come back out as Infinity): not a call
    ('{"name": "add", "arguments": {"a": 1, "b": 26e770}}', None, []),
    ('```json\n{"name": "add", "arguments": {"a": NaN, "b": 2}}\n```', None, []),
    ('[{"name": "add", "arguments": {"a": -Infinity, "b": 2}}]', None, []),
]


@pytest.mark.parametrize("text,content,calls", BARE)
def test_bare_and_fenced_calls_parse_whole_and_streamed_alike(text, content, calls):
    by_name = T.check_tools(TOOLS, "auto")
    if calls == [] and content is None:
        content = text
    got_content, got = T.parse_calls(text, by_name)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    for size in (1, 2, 5, len(text)):
        parts, rest, scalls = _stream(text, by_name, size)
        streamed = "".join(parts) + rest
        assert [(c.name, c.arguments) for c in scalls] == [(c.name, c.arguments) for c in got], size
        assert (streamed.strip() or None) == (got_content.strip() if got_content else None), size


def test_a_tagged_call_with_numbers_json_has_not_is_no_call():
    """Qwen2.5-Coder took Codex's output header `Chunk ID: 26e770` for a session id and
    wrote it as a number: Python reads it as infinity, whose arguments would go out as
    `Infinity`, which Codex cannot parse. The arguments that go out are always JSON."""
    by_name = T.check_tools(TOOLS, "auto")
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 26e770}}\n</tool_call>'
    assert T.parse_calls(text, by_name) == (text, [])
    _, calls = T.parse_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5e3}}\n</tool_call>', by_name)
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1, "b": 2500.0}]  # an exponent in range is fine


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


TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "data", "chatml_tools.jinja")
HISTORY = [{"role": "user", "content": "What is 2 + 3? Use the add tool."},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "5"}]


def test_a_template_with_a_tools_branch_gets_calls_arguments_as_objects():
    from tokenmill.model.tokenizer import ChatTemplate

    msgs = [{**m, "content": m["content"] or ""} for m in HISTORY]
    out = T.template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 3}'  # the request is not changed
    broken = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": "{a"}}]}]
    assert T.template_messages(broken) == broken  # shown as the client wrote it
    text = ChatTemplate(open(TEMPLATE).read(), None, None).render(out, True, TOOLS)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert json.dumps(WEATHER) in text and text.endswith("<|im_start|>assistant\n")


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


# -- a chat template with a tools branch (--chat-template) -----------------------------------
@pytest.fixture(scope="module")
def templated():
    srv = ServerProcess("--chat-template", TEMPLATE).wait_ready()
    yield srv
    srv.stop()


def test_code_answers_stream_while_tools_are_offered():
    """Only a candidate for a bare call is held, and only while it can still be one."""
    by_name = T.check_tools(TOOLS, "auto")
    code = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    parts, rest, calls = _stream(code, by_name, 3)
    assert not calls and "".join(parts) + rest == code
    assert "def add" in "".join(parts[:len(code) // 3 - 2])  # out before the reply ended
    answer = '{"a": 1} and more text after it, as a plain answer would go on'
    parts, rest, calls = _stream(answer, by_name, 4)
    assert not calls and "".join(parts) + rest == answer and "and more" in "".join(parts[:-2])


def test_whole_and_streamed_parses_find_the_same_calls():
    import random

    by_name = T.check_tools(TOOLS, "auto")
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    pieces = ["Sure. ", "text ", "\n", "```json\n" + call + "\n```", "```python\nx = 1\n```", call,
              "[" + call + "]", '{"a": 1}', "<tool_call>\n" + call + "\n</tool_call>",
              "<tool_call>\n{broken}\n</tool_call>", "<tool_call>", "```", "{", " after"]
    rng = random.Random(0)
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
        whole_content, whole = T.parse_calls(text, by_name)
        for size in (1, rng.randint(2, 9), len(text)):
            parts, rest, streamed = _stream(text, by_name, size)
            assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in whole], (text, size)
            if T.CALL_OPEN not in text:  # (an invalid tagged block's text is dropped from a stream)
                got = ("".join(parts) + rest).strip() or None
                assert got == ((whole_content or "").strip() or None), (text, size)


def test_served_template_renders_tools_and_history_itself(templated, embedded_path):
    """The prompt the server ran is the file's rendering of the tools and of the history
    with the call's arguments as an object: its token count says which text it was."""
    openai = pytest.importorskip("openai")
    from tokenmill.model.metadata import load_metadata
    from tokenmill.model.tokenizer import ChatTemplate

    client = openai.OpenAI(base_url=templated.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=8, temperature=0)
    _, tok = load_metadata(embedded_path)
    template = ChatTemplate(open(TEMPLATE).read(), None, None)
    msgs = [{**m, "content": m["content"] or ""} for m in HISTORY]
    right = template.render(T.template_messages(msgs), True, TOOLS)
    twice_encoded = template.render(msgs, True, TOOLS)
    assert len(tok.encode(right, add_special_tokens=False)) != len(tok.encode(twice_encoded, add_special_tokens=False))
    assert r.usage.prompt_tokens == len(tok.encode(right, add_special_tokens=False))
    own = tok.apply_chat_template([{"role": "user", "content": "hi"}])  # the model's template is not this one
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert r.usage.prompt_tokens == len(tok.encode(template.render([{"role": "user", "content": "hi"}], True),
                                                   add_special_tokens=False))
    assert own != template.render([{"role": "user", "content": "hi"}], True)


def test_served_template_forced_call_is_valid(templated):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=templated.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = _ask(client, tool_choice="required", temperature=0, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    _check_call(c.message.tool_calls[0])


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"),
    ("{% for m in messages %}{{ m.content }}", "is not a valid Jinja template"),
])
def test_a_bad_chat_template_stops_the_server_before_loading(tmp_path, content, message):
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_text(content)
    srv = ServerProcess("--chat-template", str(path))
    assert srv.proc.wait(timeout=60) != 0
    out = srv.stop()
    assert "--chat-template" in out and message in out, out


def test_call_tags_that_are_tokens_are_named_as_tokens(embedded_path):
    """Qwen2.5's vocabulary has <tool_call> and </tool_call> as added tokens, which
    llguidance takes as special: a grammar that spells the tag as a string lets the
    model's tag token through the mask and then rejects it (the request ended after one
    token). Here SmolLM2's tokenizer with the two tags added stands in for Qwen's."""
    import numpy as np
    from tokenizers import AddedToken

    from tokenmill.engine.structured.matchers import GrammarMatchers
    from tokenmill.model.metadata import load_metadata

    _, tok = load_metadata(embedded_path)
    assert not T.tags_are_tokens(tok)  # SmolLM2 spells the tags in pieces
    tok.hf.add_tokens([AddedToken(T.CALL_OPEN, special=False, normalized=False),
                       AddedToken(T.CALL_CLOSE, special=False, normalized=False)])
    assert T.tags_are_tokens(tok)
    open_id, close_id = (tok.encode(t, add_special_tokens=False)[0] for t in (T.CALL_OPEN, T.CALL_CLOSE))
    by_name = T.check_tools(TOOLS, "required")
    grammars = GrammarMatchers(tok, close_id + 1, tok.eos_token_ids)
    body = tok.encode('\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', add_special_tokens=False)
    grammars.add("call", T.call_grammar(by_name, ["add"], parallel=False, tag_tokens=True))
    allowed = np.unpackbits(grammars.fill_bitmask(["call"]).view(np.uint8), axis=1, bitorder="little")[0]
    assert np.flatnonzero(allowed).tolist() == [open_id]
    for t in [open_id, *body]:
        assert not grammars.accept("call", t)
    assert grammars.accept("call", close_id)  # complete: the call is whole
