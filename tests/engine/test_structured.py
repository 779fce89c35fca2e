"""Structured outputs in the engine: grammar masks on the embedded model (float32, exact),
under batching, chunked prefill, preemption, n > 1, logprobs, abort; validation."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.helpers import make_engine, run_to_completion
from tokenmill.engine.api import InvalidParameter, SamplingParams, StructuredOutput

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def prompt(smol):
    tok = smol.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    return tok.encode(text, add_special_tokens=False)


def _json(schema=PERSON):
    return StructuredOutput("json", schema)


def test_json_schema_greedy_sampled_and_n(smol, prompt):
    engine = make_engine(smol)
    reqs = {"g": (prompt, SamplingParams(temperature=0, max_tokens=40, structured=_json())),
            "s": (prompt, SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=40, structured=_json()))}
    _, texts, finish = run_to_completion(engine, reqs)
    for rid, by_index in texts.items():
        for i, text in by_index.items():
            jsonschema.validate(json.loads(text), PERSON)
            assert finish[rid][i] == "stop"
    assert engine.grammar.compiles == 1  # one schema, compiled once for four sequences
    assert len(engine.grammar) == 0  # every matcher freed
    assert engine.kv.num_used_blocks == 0


def test_regex_choice_lark_and_json_object(smol, prompt):
    engine = make_engine(smol)
    grammar = 'start: "ID-" DIGIT DIGIT " " WORD\nDIGIT: /[0-9]/\nWORD: /[a-z]{2,6}/'
    reqs = {"r": (prompt, SamplingParams(temperature=0, max_tokens=20,
                                         structured=StructuredOutput("regex", r"[A-Z][a-z]{1,8}, \d{2}"))),
            "c": (prompt, SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=20,
                                         structured=StructuredOutput("choice", ["red", "green", "blue jeans"]))),
            "l": (prompt, SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput("grammar", grammar))),
            "o": (prompt, SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput("json_object")))}
    _, texts, finish = run_to_completion(engine, reqs)
    assert re.fullmatch(r"[A-Z][a-z]{1,8}, \d{2}", texts["r"][0])
    assert all(t in ("red", "green", "blue jeans") for t in texts["c"].values())
    assert re.fullmatch(r"ID-\d\d [a-z]{2,6}", texts["l"][0])
    if finish["o"][0] == "stop":
        assert isinstance(json.loads(texts["o"][0]), dict)
    assert all(f == "stop" for rid in "rcl" for f in finish[rid].values())


def test_only_length_ends_it_reports_length(smol, prompt):
    engine = make_engine(smol)
    _, texts, finish = run_to_completion(engine, {"x": (prompt, SamplingParams(
        temperature=0, max_tokens=3, structured=_json()))})
    assert finish["x"][0] == "length"
    assert texts["x"][0].startswith("{")


def test_logprobs_are_of_the_constrained_distribution(smol, prompt):
    engine = make_engine(smol)
    spec = StructuredOutput("choice", ["yes", "no"])
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=5, structured=spec))
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.logprobs and first is None:
                first = out.logprobs[0]
    assert first is not None
    tok = smol.tokenizer
    finite = [(t, lp) for t, lp in first.top if lp != float("-inf")]
    # any spelling of the answer is allowed ("y", "ye", "yes", ...), nothing else
    assert all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t, _ in finite)
    assert len(finite) < len(first.top) or len(finite) == 5
    assert math.isclose(sum(math.exp(lp) for _, lp in finite), 1.0, rel_tol=1e-3)
    assert first.logprob == max(lp for _, lp in finite)


def test_batched_chunked_and_preempted_equal_single_runs(smol, prompt):
    """Mixed constrained and free requests in one batch, prefilled in chunks and with a
    cache small enough to preempt, give the tokens each gives alone (greedy, exact)."""
    specs = [_json(), None, StructuredOutput("regex", r"\d+(\.\d+)?"), None,
             _json({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4})]
    reqs = {f"r{i}": (prompt[: len(prompt) - i], SamplingParams(temperature=0, max_tokens=12, structured=s))
            for i, s in enumerate(specs)}
    alone = {}
    for rid, r in reqs.items():
        toks, _, _ = run_to_completion(make_engine(smol), {rid: r})
        alone[rid] = toks[rid][0]
    engine = make_engine(smol, max_num_batched_tokens=20, num_blocks=8, prefix_caching=False, decode_steps=8)
    toks, texts, _ = run_to_completion(engine, reqs, check=lambda e: e.kv.check_integrity())
    assert {rid: t[0] for rid, t in toks.items()} == alone
    assert engine.scheduler.num_preemptions > 0
    assert texts["r0"][0].startswith('{"')
    assert len(engine.grammar) == 0


def test_abort_frees_the_matcher(smol, prompt):
    engine = make_engine(smol)
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=30, n=2, structured=_json()))
    engine.step()
    assert len(engine.grammar) == 2
    engine.abort("x")
    assert len(engine.grammar) == 0 and not engine.has_unfinished()


def test_no_bursts_for_constrained_requests(smol, prompt):
    engine = make_engine(smol, decode_steps=8)
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=30, structured=_json()))
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        assert out.num_steps == 1
        result = engine.runner.execute(out)
        engine.scheduler.update(out, result.sampled)


@pytest.mark.parametrize("spec", [
    StructuredOutput("json", {"type": "nonsense"}),
    StructuredOutput("json", {"$ref": "#/definitions/missing"}),
    StructuredOutput("json", "{not json"),
    StructuredOutput("json", 5),
    StructuredOutput("regex", "(("),
    StructuredOutput("regex", ""),
    StructuredOutput("choice", []),
    StructuredOutput("choice", ["a", 3]),
    StructuredOutput("grammar", "start: undefined_rule"),
    StructuredOutput("yaml", "x: 1"),
])
def test_invalid_specs_are_refused_naming_the_parameter(smol, prompt, spec):
    engine = make_engine(smol)
    with pytest.raises(InvalidParameter) as exc:
        engine.add_request("x", prompt, SamplingParams(structured=spec))
    assert exc.value.param == "structured"
    assert not engine.has_unfinished()
