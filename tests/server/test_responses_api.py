"""OpenAI's Responses API (/v1/responses) driven by the official `openai` SDK against a
keyed server: answers equal the same request through /v1/chat/completions, the stream's
events in order, structured output, a function-call round trip, previous_response_id
(served from the prefix cache), background + cancel, retrieve, delete, and another
tenant's ids as 404."""

from __future__ import annotations

import json
import time
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL, ServerProcess, add_key, metric

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SYSTEM = "You are a terse assistant."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 20}}}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    db = tmp_path_factory.mktemp("keys") / "keys.db"
    keys = {name: add_key(db, name) for name in ("alice", "bob")}
    srv = ServerProcess("--keys-db", str(db), "--dtype", "float32", "--quantization", "none").wait_ready()
    yield srv, keys
    srv.stop()


def _client(srv, key):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(keyed):
    return _client(keyed[0], keyed[1]["alice"])


@pytest.fixture(scope="module")
def bob(keyed):
    return _client(keyed[0], keyed[1]["bob"])


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, temperature=0, messages=messages, **kw)


def test_plain_answer_is_the_chat_answer(alice):
    r = alice.responses.create(model=MODEL, instructions=SYSTEM, input="Name three colors.", max_output_tokens=8,
                               temperature=0, metadata={"run": "1"})
    c = chat(alice, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three colors."}],
             max_tokens=8)
    assert r.object == "response" and r.model == MODEL and r.store is True and r.metadata == {"run": "1"}
    assert r.output_text == c.choices[0].message.content
    assert r.status == {"length": "incomplete", "stop": "completed"}[c.choices[0].finish_reason]
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert alice.responses.retrieve(r.id).output_text == r.output_text
    # input as items reads the same
    items = alice.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}])
    assert items.output_text == r.output_text


def test_stream_events_in_order(alice):
    kwargs = dict(model=MODEL, instructions=SYSTEM, input="Name three colors.", max_output_tokens=10, temperature=0)
    whole = alice.responses.create(**kwargs)
    events = list(alice.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    n_deltas = kinds.count("response.output_text.delta")
    assert n_deltas >= 1
    assert kinds == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                     *["response.output_text.delta"] * n_deltas, *TEXT_EVENTS[3:], f"response.{whole.status}"]
    assert len({e.response.id for e in events if e.type.startswith("response.") and hasattr(e, "response")}) == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # the SDK's stream helper (its final response needs response.completed: an answer that ends)
    short = dict(model=MODEL, input="Is water wet? Answer yes or no.", max_output_tokens=40, temperature=0)
    with alice.responses.stream(**short) as s:
        streamed = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed" and streamed == final.output_text == alice.responses.create(**short).output_text


class Pick(BaseModel):  # bounded fields: a free string could run past max_output_tokens
    color: Literal["red", "green", "blue"]
    primary: bool


def test_structured_output(alice):
    schema = {"type": "object", "additionalProperties": False, "required": ["color", "count"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}}}
    r = alice.responses.create(model=MODEL, input="Pick a color.", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    parsed = alice.responses.parse(model=MODEL, input="Pick a color.", max_output_tokens=40, text_format=Pick)
    assert isinstance(parsed.output_parsed, Pick)


def test_function_call_round_trip(alice):
    ask = "What is the weather in Oslo?"
    forced = dict(model=MODEL, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather"})
    first = alice.responses.create(**forced)
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(alice.responses.create(stream=True, **forced))
    kinds = [e.type for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]
    assert next(e for e in events if e.type == "response.function_call_arguments.done").arguments == \
        calls[0].arguments
    # the output goes back by previous_response_id, and equals the stateless spelling
    result = [{"type": "function_call_output", "call_id": c.call_id, "output": "12 C, clear"} for c in calls]
    second = alice.responses.create(model=MODEL, previous_response_id=first.id, input=result, tools=[WEATHER],
                                    temperature=0, max_output_tokens=8)
    stateless = alice.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": ask},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
        *result])
    assert second.output_text and second.output_text == stateless.output_text
    c = chat(alice, [{"role": "user", "content": ask}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": x.call_id, "type": "function", "function": {"name": x.name, "arguments": x.arguments}} for x in calls]},
        *[{"role": "tool", "tool_call_id": x.call_id, "content": "12 C, clear"} for x in calls]],
        tools=[CHAT_WEATHER], max_tokens=8)
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens


def test_namespace_tools_and_hosted_ones_as_codex_sends_them(alice):
    """Codex CLI groups tools in `namespace` tools and adds hosted ones (web_search): the
    namespace's functions are offered under one flat name each and come back as a call with
    `name` and `namespace` apart (Codex routes by both), which round-trips as input; a
    hosted tool is left out, not refused."""
    ns = {"type": "namespace", "name": "weather_v1", "description": "Weather tools.",
          "tools": [{k: v for k, v in WEATHER.items()}]}
    ask = "What is the weather in Oslo?"
    forced = dict(model=MODEL, input=ask, tools=[ns, {"type": "web_search", "external_web_access": True}],
                  temperature=0, max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather", "namespace": "weather_v1"})
    first = alice.responses.create(**forced)
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].namespace == "weather_v1", first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    done = next(e for e in alice.responses.create(stream=True, **forced) if e.type == "response.output_item.done")
    assert (done.item.name, done.item.namespace, done.item.arguments) == ("get_weather", "weather_v1",
                                                                          calls[0].arguments)
    back = [{"type": "function_call", "call_id": c.call_id, "name": c.name, "namespace": c.namespace,
             "arguments": c.arguments} for c in calls]
    result = [{"type": "function_call_output", "call_id": c.call_id, "output": "12 C, clear"} for c in calls]
    second = alice.responses.create(model=MODEL, tools=[ns], temperature=0, max_output_tokens=8,
                                    input=[{"role": "user", "content": ask}, *back, *result])
    flat = {**CHAT_WEATHER, "function": {**CHAT_WEATHER["function"], "name": "weather_v1__get_weather"}}
    c = chat(alice, [{"role": "user", "content": ask}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": x.call_id, "type": "function", "function": {"name": "weather_v1__get_weather",
                                                           "arguments": x.arguments}} for x in calls]},
        *[{"role": "tool", "tool_call_id": x.call_id, "content": "12 C, clear"} for x in calls]],
        tools=[flat], max_tokens=8)
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens


def test_previous_response_id_continues_from_the_cache(alice):
    first = alice.responses.create(model=MODEL, instructions=SYSTEM, temperature=0, max_output_tokens=8,
                                   input="Write one sentence about the sea.")
    then = alice.responses.create(model=MODEL, instructions=SYSTEM, temperature=0, max_output_tokens=8,
                                  previous_response_id=first.id, input="Now one about the sky.")
    assert then.previous_response_id == first.id
    assert then.usage.input_tokens_details.cached_tokens > 0
    c = chat(alice, [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Write one sentence about the sea."},
                     {"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "Now one about the sky."}], max_tokens=8)
    assert then.output_text == c.choices[0].message.content and then.usage.input_tokens == c.usage.prompt_tokens


def _wait(client, rid, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        time.sleep(0.2)
    raise AssertionError(f"{rid} still {r.status}")


def test_background_and_cancel(keyed, alice):
    srv, _ = keyed
    kwargs = dict(model=MODEL, input="Name three colors.", max_output_tokens=6, temperature=0)
    queued = alice.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background is True
    done = _wait(alice, queued.id)
    assert done.output_text == alice.responses.create(**kwargs).output_text and done.usage.output_tokens > 0
    long = alice.responses.create(model=MODEL, input="Tell a very long story.", max_output_tokens=2000,
                                  background=True)
    cancelled = alice.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and alice.responses.retrieve(long.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(srv, "tokenmill_kv_blocks_used") > 0:
        time.sleep(0.1)
    assert metric(srv, "tokenmill_kv_blocks_used") == 0  # the engine let it go
    assert alice.responses.cancel(long.id).status == "cancelled"  # again: no change
    with pytest.raises(openai.BadRequestError):
        alice.responses.cancel(alice.responses.create(**kwargs).id)  # only background ones
    with pytest.raises(openai.BadRequestError):
        alice.responses.create(background=True, store=False, **kwargs)


def test_retrieve_delete_and_store_false(alice):
    r = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert alice.responses.retrieve(r.id).id == r.id
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.delete(r.id)
    unstored = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_another_tenants_ids_are_404(alice, bob):
    r = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for attempt in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                    lambda: bob.responses.cancel(r.id),
                    lambda: bob.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                                 previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert alice.responses.retrieve(r.id).id == r.id


@pytest.mark.parametrize("kwargs,param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "x"}]}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"model": "gpt-x"}, "model"),
    ({"background": True, "stream": True}, "stream"),
])
def test_bad_input_is_a_400(alice, kwargs, param):
    with pytest.raises(openai.APIStatusError) as e:
        alice.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 2, **kwargs})
    assert 400 <= e.value.status_code < 500 and e.value.body["param"] == param, e.value.body
