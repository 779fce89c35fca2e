"""A structured-output spec -> an llguidance grammar string, and its validation.

Works without a tokenizer and without torch, so `RequestLimits.check` (which may run
in the server process) refuses a bad schema, regex or grammar before anything is
queued. JSON is generated compact (no free whitespace): a small model given the
freedom to emit whitespace may emit only that.
"""

from __future__ import annotations

import json
from functools import lru_cache

from tokenmill.engine.types import InvalidParameter, StructuredOutput

# JSON compile options: compact separators, oneOf read as anyOf (both branches valid is
# the usual case for generated schemas), the schema's own `x-guidance` may override.
_JSON_OPTIONS = {"whitespace_flexible": False, "coerce_one_of": True}
MAX_SPEC_CHARS = 100_000  # a bound on what one request may ask the compiler to digest
PARAM = "structured"  # SamplingParams' name; the server renames it to the field the client set


def spec_key(spec: StructuredOutput) -> str:
    """A canonical string for a spec: the cache key of its compiled grammar."""
    return json.dumps([spec.kind, spec.value], sort_keys=True, separators=(",", ":"))


def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar (a JSON string) for a spec. Does not validate."""
    return _grammar(spec_key(spec))


@lru_cache(maxsize=512)
def _grammar(key: str) -> str:
    import llguidance as llg

    kind, value = json.loads(key)
    if kind == "json":
        schema = value if isinstance(value, (dict, bool)) else json.loads(value)
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        # Lark string literals take JSON escapes
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        return llg.LLMatcher.grammar_from_lark(value)
    raise ValueError(f"unknown structured output kind {kind!r}")


def validate(spec: StructuredOutput) -> None:
    """Raise InvalidParameter('structured') unless the spec compiles to a valid grammar."""
    def bad(message: str) -> InvalidParameter:
        return InvalidParameter(PARAM, f"{PARAM} is not a valid output constraint: {message}")

    kind, value = spec.kind, spec.value
    if kind not in StructuredOutput.KINDS:
        raise bad(f"kind must be one of {', '.join(StructuredOutput.KINDS)}, got {kind!r}")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise bad("a JSON schema must be an object")
    elif kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise bad("choice must be a non-empty list of non-empty strings")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise bad(f"{kind} must be a non-empty string")
    try:
        size = len(spec_key(spec))
    except (TypeError, ValueError) as exc:
        raise bad(f"not serializable: {exc}") from None
    if size > MAX_SPEC_CHARS:
        raise bad(f"the constraint is too large ({size} characters; at most {MAX_SPEC_CHARS})")
    import llguidance as llg

    try:
        grammar = grammar_of(spec)
    except (ValueError, TypeError) as exc:
        raise bad(str(exc)) from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise bad(messages[0] if messages else "the grammar does not compile")
