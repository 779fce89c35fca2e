"""Structured outputs through the HTTP API, driven by the unmodified openai SDK:
response_format (json_object, json_schema, the SDK's parse helper), vLLM's guided_*
extensions on both endpoints, validation errors, and masks under batching (exact mode)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tests.server.conftest import MODEL

jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

S = {"type": "string", "maxLength": 16}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


# Real shapes: nested objects, arrays with bounds, enums, required and optional fields,
# bounded numbers, string patterns and formats, anyOf, $ref/$defs, consts. Strings and
# arrays are bounded, so every output ends well inside max_tokens; so are the numbers'
# decimals (multipleOf): a bare "number" admits endless digits, and a greedy 135M model
# writes 1.000000... until max_tokens cuts it.
SCHEMAS: list[dict] = [
    obj({"name": S, "age": INT}),
    obj({"city": S, "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.1}, "unit": {"enum": ["C", "F"]}}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": INT, "minItems": 2, "maxItems": 4}}),
    obj({"user": obj({"id": INT, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}})}),
    obj({"point": obj({"x": INT, "y": INT}), "label": S}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"status": {"type": "string", "enum": ["active", "inactive", "pending"]}, "count": INT}),
    obj({"name": S, "nickname": S}, required=["name"]),
    obj({"value": {"anyOf": [INT, {"type": "string", "maxLength": 8}]}}),
    obj({"result": {"anyOf": [obj({"error": S}), obj({"data": INT})]}}),
    obj({"a": {"$ref": "#/$defs/item"}, "b": {"$ref": "#/$defs/item"}},
        **{"$defs": {"item": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": INT})}}),
    obj({"items": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 2}},
        **{"$defs": {"line": obj({"product": S, "price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.01}})}}),
    obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                              "minItems": 2, "maxItems": 2}}}),
    obj({"version": {"const": "1.0"}, "name": S}),
    obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                 "minItems": 3, "maxItems": 3}}),
    obj({"title": S, "author": obj({"first": S, "last": S}), "year": {"type": "integer", "minimum": 1800,
                                                                     "maximum": 2030}}),
    obj({"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.05}}),
    obj({"event": S, "attendees": {"type": "array", "items": obj({"name": S, "rsvp": {"type": "boolean"}}),
                                   "minItems": 1, "maxItems": 2}}),
    obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}}),
    obj({"flags": obj({"admin": {"type": "boolean"}, "beta": {"type": "boolean"}}), "level": INT}),
    obj({"kind": {"enum": ["circle", "square"]}, "size": {"type": "integer", "minimum": 1, "maximum": 10}}),
    obj({"shape": {"anyOf": [obj({"radius": INT}), obj({"side": INT})]}}),
    obj({"price": {"type": "number", "minimum": 0.5, "maximum": 9.5, "multipleOf": 0.5}, "currency": {"enum": ["EUR", "USD"]}}),
    obj({"words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,6}$"},
                   "minItems": 2, "maxItems": 3}}),
    obj({"meta": obj({"created": {"type": "string", "pattern": "^[0-9]{4}$"}, "tags": {
        "type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 2}}), "id": INT}),
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 3},
    {"type": "string", "enum": ["north", "south", "east", "west"]},
    obj({"nullable": {"anyOf": [{"type": "null"}, INT]}, "name": S}),
    obj({"level1": obj({"level2": obj({"level3": obj({"leaf": {"type": "boolean"}})})})}),
]

MESSAGES = [{"role": "user", "content": "Reply with JSON."}]


def test_enough_schemas():
    assert len(SCHEMAS) >= 30
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s)


def test_json_schemas_validate_greedy_and_sampled(server):
    """Every schema greedy, and sampled at temperature 1 with seeds 1, 2, 3 in turn, all
    at once (the server batches them)."""
    openai = pytest.importorskip("openai")
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=1200)

    async def one(i: int, schema: dict, temperature: float, seed: int | None):
        r = await aclient.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=160, temperature=temperature, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})
        c = r.choices[0]
        return i, temperature, seed, c.finish_reason, c.message.content

    async def run():
        jobs = [one(i, s, t, seed) for i, s in enumerate(SCHEMAS)
                for t, seed in ((0.0, None), (1.0, 1 + i % 3))]
        return await asyncio.gather(*jobs)

    for i, t, seed, finish, text in asyncio.run(run()):
        where = f"schema {i} at temperature {t} seed {seed}: {text!r}"
        assert finish == "stop", where
        jsonschema.validate(json.loads(text), SCHEMAS[i]), where


def test_parse_returns_a_pydantic_object(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=10_000_000)
        capital: bool

    r = client.chat.completions.parse(model=MODEL, messages=[
        {"role": "user", "content": "Describe Paris."}], response_format=City, temperature=0, max_tokens=80)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert 0 <= parsed.population <= 10_000_000


def test_json_object_always_parses(aclient):
    async def one(seed):
        r = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Give a tiny JSON object with one key."}],
            response_format={"type": "json_object"}, temperature=0.7, seed=seed, max_tokens=60)
        return r.choices[0]

    async def run():
        return await asyncio.gather(*(one(s) for s in range(4)))

    choices = asyncio.run(run())
    for c in choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # cut by max_tokens: still the start of one object
            assert c.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in choices)


def test_regex_and_choice_hold_on_both_endpoints(client):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    for t in (0.0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=t, seed=3, max_tokens=20,
                                           extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content
        r = client.completions.create(model=MODEL, prompt="The best colour is", temperature=t, seed=3, n=3,
                                      max_tokens=10, extra_body={"guided_choice": ["red", "green", "sky blue"]})
        assert all(c.text in ("red", "green", "sky blue") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=0,
                                  extra_body={"guided_grammar": 'start: "A" | "B" "!"'})
    assert r.choices[0].text in ("A", "B!")
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40, temperature=0,
                                  extra_body={"guided_json": {"type": "array", "items": {"type": "boolean"},
                                                              "minItems": 1, "maxItems": 3}})
    assert all(isinstance(x, bool) for x in json.loads(r.choices[0].text))


def test_streamed_constrained_output_equals_the_whole(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
             if c.choices]
    assert "".join(parts) == whole


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_parameter(client, extra, param):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert exc.value.body["param"] == param, exc.value.body


def test_masks_are_right_under_batching(aclient):
    """16 requests, constrained and free mixed, give in one batch what each gives alone
    (the exact-mode server's outputs do not depend on batching)."""
    fmts = [None, {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[1]}},
            {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMAS[6]}}]
    extras = [{}, {}, {}, {}, {"guided_regex": r"[a-z]{3,10}"}, {"guided_choice": ["up", "down"]}]

    async def one(i: int):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": f"Item {i}: describe it."}],
                      max_tokens=24, temperature=0)
        fmt, extra = fmts[i % 4], extras[i % 6]
        if extra:
            kwargs["extra_body"] = extra
        elif fmt is not None:
            kwargs["response_format"] = fmt
        r = await aclient.chat.completions.create(**kwargs)
        return r.choices[0].message.content

    async def run():
        together = await asyncio.gather(*(one(i) for i in range(16)))
        alone = [await one(i) for i in range(16)]
        return together, alone

    together, alone = asyncio.run(run())
    assert together == alone
