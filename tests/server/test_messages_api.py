"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the
official `anthropic` SDK against a keyed server: plain and streamed answers equal the
same request through /v1/chat/completions, a tool-use round trip, count_tokens equals
the usage, stop sequences, and every error parsed as Anthropic's."""

from __future__ import annotations

import json
import time
from datetime import datetime

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, add_key

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SYSTEM = "You are a terse assistant."
ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 20}}}}
# The SDK pinned here has no temperature argument any more; the wire field is still read
# (greedy answers can be compared with chat's), so it goes in extra_body.
GREEDY = {"temperature": 0}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    db = tmp_path_factory.mktemp("keys") / "keys.db"
    keys = {"alice": add_key(db, "alice", "--rpm", "1000", "--tpm", "1000000"),
            "tight": add_key(db, "tight", "--rpm", "3")}
    srv = ServerProcess("--keys-db", str(db), "--dtype", "float32", "--quantization", "none").wait_ready()
    yield srv, keys
    srv.stop()


@pytest.fixture(scope="module")
def claude(keyed):
    srv, keys = keyed
    return anthropic.Anthropic(base_url=srv.url, api_key=keys["alice"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def gpt(keyed):
    srv, keys = keyed
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=keys["alice"], max_retries=0, timeout=120)


def test_a_system_message_mid_conversation_as_claude_code_sends_it(claude, gpt):
    """Claude Code 2.1 puts system reminders in `messages` with role system: read as chat's
    system messages are, where they stand."""
    turn = [*ASK, {"role": "system", "content": [{"type": "text", "text": "Answer in one line."}]}]
    msg = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=SYSTEM, messages=turn)
    chat = gpt.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, *ASK, {"role": "system", "content": "Answer in one line."}])
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_plain_answer_is_the_chat_answer(claude, gpt):
    msg = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=SYSTEM, messages=ASK)
    chat = gpt.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert isinstance(msg, anthropic.types.Message) and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    # the same prompt again is read from the prefix cache, and says so
    again = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=SYSTEM, messages=ASK)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # system as text blocks reads the same
    blocks = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=ASK,
                                    system=[{"type": "text", "text": SYSTEM}])
    assert blocks.content[0].text == msg.content[0].text


def test_stream_events_in_order(keyed, claude):
    kwargs = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, system=SYSTEM, messages=ASK)
    whole = claude.messages.create(**kwargs)
    events = list(claude.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.id.startswith("msg") and events[0].message.usage.input_tokens > 0
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude.messages.stream(**kwargs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == whole.stop_reason
    # on the wire: Anthropic's event names, a ping after message_start
    srv, keys = keyed
    wire = {**kwargs, **kwargs.pop("extra_body"), "stream": True}
    with httpx.stream("POST", srv.url + "/v1/messages", json=wire, timeout=120,
                      headers={"x-api-key": keys["alice"]}) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence(claude, stream):
    kwargs = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, system=SYSTEM, messages=ASK)
    text = claude.messages.create(**kwargs).content[0].text
    words = [w for w in text.split() if len(w) > 2]
    stop = words[len(words) // 2]
    if stream:
        with claude.messages.stream(stop_sequences=[stop], **kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = claude.messages.create(stop_sequences=[stop], **kwargs)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_tool_use_round_trip(claude, gpt):
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = claude.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER], messages=ask,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with claude.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER], messages=ask,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert streamed.stop_reason == "tool_use"
    # the result goes back as a tool_result block; the reply is what chat gives the same turn
    turn = [*ask, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "12 C, clear"}
                                         for u in uses]}]
    second = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, tools=[WEATHER], messages=turn)
    assert second.content and second.content[0].type == "text"
    chat_turn = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
        for u in uses]}, *[{"role": "tool", "tool_call_id": u.id, "content": "12 C, clear"} for u in uses]]
    chat = gpt.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[CHAT_WEATHER],
                                       messages=chat_turn)
    assert second.content[0].text == chat.choices[0].message.content
    assert claude.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=turn).input_tokens == \
        chat.usage.prompt_tokens


def test_count_tokens_equals_usage(claude):
    kwargs = dict(model=MODEL, system=SYSTEM, tools=[WEATHER], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Rome?"}]}])
    count = claude.messages.count_tokens(**kwargs).input_tokens
    u = claude.messages.create(max_tokens=2, **kwargs).usage
    assert count == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert count > claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=kwargs["messages"]).input_tokens


def _raises(kind, fn, status, error_type):
    with pytest.raises(kind) as e:
        fn()
    err = e.value
    assert err.status_code == status and err.type == error_type and err.api_message, err.body
    assert err.body["type"] == "error" and set(err.body["error"]) == {"type", "message"}
    assert err.request_id
    return err


def test_errors_parse_as_anthropic_errors(keyed, claude):
    srv, keys = keyed
    ok = dict(model=MODEL, max_tokens=4, messages=ASK)
    _raises(anthropic.BadRequestError, lambda: claude.messages.create(**{**ok, "max_tokens": 0}), 400,
            "invalid_request_error")
    _raises(anthropic.BadRequestError, lambda: claude.messages.create(**ok, extra_body={"temperature": -1}), 400,
            "invalid_request_error")
    err = _raises(anthropic.BadRequestError, lambda: claude.messages.create(**ok, stop_sequences=["x"] * 17), 400,
                  "invalid_request_error")
    assert "stop_sequences" in err.api_message
    _raises(anthropic.BadRequestError, lambda: claude.messages.create(**{**ok, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": "AAAA"}}]}]}), 400, "invalid_request_error")
    _raises(anthropic.BadRequestError, lambda: claude.messages.create(**{**ok, "messages": [
        *ASK, {"role": "assistant", "content": "Red"}]}), 400, "invalid_request_error")
    _raises(anthropic.BadRequestError, lambda: claude.messages.create(**ok, tools=[WEATHER],
                                                                      tool_choice={"type": "tool", "name": "nope"}),
            400, "invalid_request_error")
    _raises(anthropic.BadRequestError, lambda: claude.messages.create(**ok, stream=True, tools=[
        {"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error")
    _raises(anthropic.NotFoundError, lambda: claude.messages.create(**{**ok, "model": "claude-x"}), 404,
            "not_found_error")
    _raises(anthropic.BadRequestError, lambda: claude.messages.count_tokens(model=MODEL, messages=[]), 400,
            "invalid_request_error")
    stranger = anthropic.Anthropic(base_url=srv.url, api_key="tm-not-a-key", max_retries=0)
    _raises(anthropic.AuthenticationError, lambda: stranger.messages.create(**ok), 401, "authentication_error")
    _raises(anthropic.ContentTooLargeError, lambda: claude.messages.create(**{**ok, "messages": [
        {"role": "user", "content": "a" * (9 << 20)}]}), 413, "request_too_large")
    # missing max_tokens (the SDK will not send that itself)
    r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": keys["alice"]}, timeout=60,
                   json={"model": MODEL, "messages": ASK})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    assert claude.messages.create(**ok).content  # nothing else disturbed


def test_error_mid_stream_is_an_error_event(claude):
    """A deadline passing mid-stream can only be told in-band: Anthropic's `error` event."""
    with pytest.raises(anthropic.APIStatusError) as e:
        with claude.messages.stream(model=MODEL, max_tokens=2000, extra_body=GREEDY, extra_headers={
                "X-Request-Timeout": "0.5"}, messages=[{"role": "user", "content": "Tell a long story."}]) as s:
            for _ in s:
                pass
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "timeout_error"


def test_rate_limit_headers_and_429(keyed):
    srv, keys = keyed
    tight = anthropic.Anthropic(base_url=srv.url, api_key=keys["tight"], max_retries=0, timeout=120)
    raw = tight.messages.with_raw_response.create(model=MODEL, max_tokens=1, messages=ASK)
    h = raw.headers
    assert h["anthropic-ratelimit-requests-limit"] == h["x-ratelimit-limit-requests"] == "3"
    assert int(h["anthropic-ratelimit-requests-remaining"]) <= 2
    reset = datetime.fromisoformat(h["anthropic-ratelimit-requests-reset"].replace("Z", "+00:00"))
    assert time.time() - 2 <= reset.timestamp() <= time.time() + 61
    assert h["request-id"] == h["x-request-id"]
    raw.parse()
    with pytest.raises(anthropic.RateLimitError) as e:
        for _ in range(3):
            tight.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    assert e.value.type == "rate_limit_error" and int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"


def test_structured_output(claude):
    schema = {"type": "object", "additionalProperties": False, "required": ["color", "count"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}}}
    msg = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)
