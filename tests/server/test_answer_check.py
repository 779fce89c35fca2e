"""The check a request carries, applied to an answer's text (tokenmill/server/answer_check.py):
a json_schema response_format and forced tool calls; validation is jsonschema's (the
eval checkers'), run on real request bodies as the server parses them."""

from __future__ import annotations

import json

from tokenmill.server.answer_check import carries_check, passes
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "count", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **kw})


def call(name: str, args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_json_schema_answers_must_parse_and_validate():
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    for body in (chat(response_format=rf), CompletionRequest.model_validate({"model": "m", "prompt": "x",
                                                                            "response_format": rf})):
        assert carries_check(body)
        assert passes(body, '{"n": 3}', None)
        for bad in ('{"n": 0}', '{"n": "3"}', '{}', '{"n": 3', '', 'n=3', '{"n": 3} and more'):
            assert not passes(body, bad, None), bad
    for unchecked in (chat(), chat(response_format={"type": "json_object"}), chat(tools=TOOLS),
                      chat(tools=TOOLS, tool_choice="auto"), chat(tools=TOOLS, tool_choice="none")):
        assert not carries_check(unchecked)


def test_forced_tool_calls_must_name_the_tool_and_match_its_parameters():
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "count"}})
    required = chat(tools=TOOLS, tool_choice="required")
    assert carries_check(named) and carries_check(required)
    assert passes(named, call("count", {"n": 2}), None)
    assert not passes(named, call("count", {"n": -1}), None)  # arguments against the tool's parameters
    assert not passes(named, call("other", {}), None)  # not the function it had to call
    assert not passes(named, call("count", {"n": 2})[:-5], None)  # cut short: no complete call
    assert not passes(named, "no call at all", None)
    assert passes(required, call("other", {"x": 1}) + "\n" + call("count", {"n": 1}), None)
    assert not passes(required, call("other", {}) + "\n" + call("count", {"n": 0}), None)  # every call
