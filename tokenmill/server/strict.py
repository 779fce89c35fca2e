"""OpenAI's strict mode for JSON schemas (`response_format` json_schema and function tools
with `strict: true`): the output has only the properties an object schema lists, unless
the schema itself allows more.

JSON Schema's own default lets an object carry any property it does not list, and the
grammar follows the schema: a model then may (and small ones do) add a property of its
own and fill it until max_tokens. Under strict, OpenAI never generates one, and vLLM's
grammar engine treats a missing `additionalProperties` as false. So a strict schema's
object schemas that list properties get `additionalProperties: false` where they say
nothing about extra properties; a non-strict schema is left as JSON Schema reads it.
"""

from __future__ import annotations

from typing import Any

# where a schema keeps its subschemas: one, a name -> schema map, or a list
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SAYS_MORE = ("additionalProperties", "unevaluatedProperties")


def strict_schema(schema: Any) -> Any:
    """`schema` with every object schema that lists properties closed to others, unless it
    sets additionalProperties or unevaluatedProperties itself. A copy; `schema` is kept."""
    return _close(schema, closable=True)


def function_parameters(fn: dict[str, Any]) -> Any:
    """A function tool's `parameters` as its calls' arguments must match them (any object
    when it has none), closed under the tool's `strict: true`."""
    params = fn.get("parameters") or {"type": "object"}
    return strict_schema(params) if fn.get("strict") is True else params


def _close(node: Any, closable: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], True)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, True) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            # an allOf part lists only some of the object's properties: closing it alone
            # would refuse the others' (its nested objects are closed all the same)
            out[key] = [_close(sub, key != "allOf") for sub in out[key]]
    lists = "properties" in out or "patternProperties" in out
    if closable and lists and not any(k in out for k in _SAYS_MORE):
        out["additionalProperties"] = False
    return out
