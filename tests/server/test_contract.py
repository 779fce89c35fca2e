"""Where OpenAI's contract is stricter than a lenient server: message shapes it refuses,
and strict JSON schemas, driven through the official openai SDK."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server.conftest import MODEL

openai = pytest.importorskip("openai")

USER = {"role": "user", "content": "What is 2 + 3?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@pytest.mark.parametrize("messages,param,words", [
    ([USER, {"role": "tool"}], "messages.[1].tool_call_id", "must have a 'tool_call_id'"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "5"}],
     "messages.[2].tool_call_id", "must have a 'tool_call_id'"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1"}],
     "messages.[2].content", "Missing required parameter: 'messages.[2].content'"),
    ([USER, {"role": "assistant"}, USER], "messages.[1].content", "needs content or tool_calls"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}, USER], "messages.[1].content",
     "needs content or tool_calls"),
])
def test_malformed_messages_are_refused_naming_the_parameter(client, messages, param, words):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    err = ei.value.body
    assert ei.value.status_code == 400 and err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_well_formed_tool_history_and_empty_assistant_content_are_answered(client):
    for messages in ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "c1", "content": "5"}],
                     [USER, {"role": "assistant", "content": ""}, USER]):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")


def test_a_body_without_the_sdk_gets_the_same_error(server):
    """The rule lives in the request model (a validator raising InvalidParameter), so the
    error is the same 400 whichever path parses the body."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [USER, {"role": "tool", "content": "5"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.[1].tool_call_id"


KEY = re.compile(r'[{,]"((?:[^"\\]|\\.)*)":')  # compact JSON, as the grammar writes it


def _keys(text: str) -> set[str]:
    return set(KEY.findall(text))


def test_strict_json_schema_generates_only_listed_properties(client):
    """A schema that lists one property and says nothing of others: sampled hot, the model
    adds properties of its own without strict (JSON Schema allows them), never with it."""
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    messages = [{"role": "user", "content": "Describe a cat as a JSON object: its name, color and age."}]

    def keys(strict: bool) -> list[set[str]]:
        r = client.with_options(timeout=300).chat.completions.create(  # sampled under a grammar: slow steps
            model=MODEL, messages=messages, n=6, temperature=1.3, seed=11, max_tokens=12,
            response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema,
                                                                    "strict": strict}})
        out = []
        for c in r.choices:
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.message.content), dict)
            out.append(_keys(c.message.content))
        return out

    loose = keys(False)
    assert any(k - {"age"} for k in loose), loose  # the test can tell the two apart
    assert all(k <= {"age"} for k in keys(True))


def test_strict_function_tool_calls_only_listed_arguments(client):
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": params, "strict": True}}]
    r = client.with_options(timeout=300).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris, in detail please?"}], n=3,
        temperature=1.3, seed=5, max_tokens=40, tools=tools,
        tool_choice={"type": "function", "function": {"name": "weather"}})
    calls = [call for c in r.choices for call in (c.message.tool_calls or [])]
    assert calls, [c.message.content for c in r.choices]
    for call in calls:
        assert call.function.name == "weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_token_rate_limit_headers_are_always_sent(server, client):
    """An open server (no keys, so no TPM limit): the token headers report the server's
    capacity, never less than its KV cache, less what it processed in the last minute."""
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=[USER], max_tokens=4)
    h = raw.headers
    limit, remaining = int(h["x-ratelimit-limit-tokens"]), int(h["x-ratelimit-remaining-tokens"])
    engine = httpx.get(server.url + "/v1/stats", timeout=10).json()["engine"]
    assert limit >= engine["kv_blocks_total"] * 16  # the default block size
    assert 0 <= remaining < limit  # this request's tokens were processed within the minute
    assert re.fullmatch(r"(\d+h)?(\d+m)?[\d.]+m?s", h["x-ratelimit-reset-tokens"])
    assert "x-ratelimit-limit-requests" not in h  # no request limit to report
    models = httpx.get(server.url + "/v1/models", timeout=10)
    assert int(models.headers["x-ratelimit-limit-tokens"]) >= limit
