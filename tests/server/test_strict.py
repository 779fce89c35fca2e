"""Strict JSON schemas (OpenAI's `strict: true`): object schemas that list properties are
closed to others unless they say otherwise, and the grammar built from them refuses an
unlisted property that the same schema without strict allows."""

from __future__ import annotations

import llguidance as llg
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tokenmill.engine.api import StructuredOutput
from tokenmill.engine.structured.grammar import grammar_of
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.strict import function_parameters, strict_schema
from tokenmill.server.tools import call_grammar, check_tools

CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
       "required": ["name"]}


@pytest.fixture(scope="module")
def bytes_tokenizer():
    """A byte-level tokenizer (one token per byte, and an end token): any text has one
    tokenization, so what a grammar accepts is what its matcher takes."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    eos = vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return tok, llg.LLTokenizer(tok.to_str(), n_vocab=len(vocab), eos_token=[eos])


def accepts(bytes_tokenizer, spec: StructuredOutput, text: str) -> bool:
    tok, lltok = bytes_tokenizer
    m = llg.LLMatcher(lltok, grammar_of(spec), log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok.encode(text, add_special_tokens=False).ids
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_strict_closes_listed_objects_only():
    schema = {
        "type": "object",
        "properties": {
            "pet": CAT,
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": True},
            "free": {"type": "object"},  # lists nothing: any object, as before
            "properties": {"type": "object", "properties": {"p": {"type": "integer"}}},  # a property so named
            "either": {"anyOf": [{"$ref": "#/$defs/Dog"}, {"type": "null"}]},
            "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                               {"type": "object", "properties": {"b": {"type": "object",
                                                                       "properties": {"c": {"type": "integer"}}}}}]},
        },
        "$defs": {"Dog": {"type": "object", "properties": {"bark": {"type": "boolean"}}}},
    }
    out = strict_schema(schema)
    p = out["properties"]
    assert out["additionalProperties"] is False
    assert p["pet"]["additionalProperties"] is False and p["pet"]["required"] == ["name"]
    assert p["tags"]["items"]["additionalProperties"] is False
    assert p["extra"]["additionalProperties"] is True  # the schema allows more: kept
    assert "additionalProperties" not in p["free"]
    assert p["properties"]["additionalProperties"] is False and set(p["properties"]["properties"]) == {"p"}
    assert out["$defs"]["Dog"]["additionalProperties"] is False
    a, b = p["both"]["allOf"]
    assert "additionalProperties" not in a and "additionalProperties" not in b  # parts of one object
    assert b["properties"]["b"]["additionalProperties"] is False  # what they hold is closed
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["pet"]
    assert strict_schema(True) is True


def test_the_grammar_refuses_an_unlisted_property_only_under_strict(bytes_tokenizer):
    # (llguidance writes an optional property before the required ones)
    listed, unlisted = '{"age":3,"name":"Tom"}', '{"name":"Tom","description":"a cat"}'
    loose, strict = StructuredOutput("json", CAT), StructuredOutput("json", strict_schema(CAT))
    assert accepts(bytes_tokenizer, loose, listed) and accepts(bytes_tokenizer, strict, listed)
    assert accepts(bytes_tokenizer, loose, unlisted)  # JSON Schema's default: allowed
    assert not accepts(bytes_tokenizer, strict, unlisted)


def test_response_format_strict_reaches_the_constraint(bytes_tokenizer):
    def spec(strict):
        body = ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": "a cat"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT,
                                                                       **({} if strict is None else {"strict": strict})}}})
        return body.structured()[0]

    assert not accepts(bytes_tokenizer, spec(True), '{"name":"Tom","description":"x"}')
    for loose in (spec(False), spec(None)):
        assert accepts(bytes_tokenizer, loose, '{"name":"Tom","description":"x"}')


def test_strict_function_tools_call_with_listed_arguments_only(bytes_tokenizer):
    def grammar(strict):
        tools = [{"type": "function", "function": {"name": "pet", "parameters": CAT,
                                                   **({"strict": True} if strict else {})}}]
        return call_grammar(check_tools(tools, "required"), ["pet"], parallel=False)

    call = '<tool_call>\n{"name":"pet","arguments":{"name":"Tom"%s}}\n</tool_call>'
    assert accepts(bytes_tokenizer, grammar(True), call % "")
    assert not accepts(bytes_tokenizer, grammar(True), call % ',"description":"x"')
    assert accepts(bytes_tokenizer, grammar(False), call % ',"description":"x"')
    assert function_parameters({"name": "f"}) == {"type": "object"}
