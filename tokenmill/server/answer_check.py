"""The automatic check a request carries, applied to its answer: where a rollout's arms
are compared on success (rollouts.py), not only on errors, latency and agreement.

A request carries a check when its answer's shape is fixed by the request itself:

- `response_format` of type `json_schema` (chat and completions): the answer's text is
  one JSON value (nothing around it) that validates against the schema;
- tool calls it must make (`tool_choice` "required" or a named function, chat): the
  answer holds at least one complete call, each naming an offered tool, and every
  call's arguments validate against that tool's parameters (closed, for `strict`).

Every sample of a request must pass. An answer cut short by its token limit fails (its
JSON or its call is unfinished): a candidate that stops early is worse for the client.
The JSON Schema validation is the eval checkers' (tokenmill/eval/checkers.py).
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.eval.checkers import schema_error
from tokenmill.server import reasoning as thinking
from tokenmill.server import tools as tool_calls
from tokenmill.server.strict import function_parameters


def carries_check(body: Any) -> bool:
    """Whether `body`'s answers can be checked automatically (above)."""
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None and \
            rf.json_schema.schema_ is not None:
        return True
    return _forced_tools(body) is not None


def _forced_tools(body: Any) -> list[str] | None:
    if not getattr(body, "tools_active", False):
        return None
    try:
        return tool_calls.forced_names(body.tools_by_name(), body.tool_choice)
    except ValueError:  # malformed tools: the request is refused before it runs
        return None


def passes(body: Any, text: str, reasoning_kind: str | None) -> bool:
    """Whether one sample's answer `text` (as the engine wrote it) passes the check `body`
    carries. `reasoning_kind`: the model's reasoning parser, when the request thinks."""
    answer_thinking = getattr(body, "_thinking", None)
    if answer_thinking is not None and reasoning_kind is not None:
        text = thinking.split(reasoning_kind, text, answer_thinking.inside)[1] or ""
    names = _forced_tools(body)
    if names is not None:
        by_name = body.tools_by_name()
        _, calls = tool_calls.parse_calls(text, by_name)
        return bool(calls) and all(
            c.name in names and schema_error(function_parameters(by_name[c.name]), json.loads(c.arguments)) is None
            for c in calls)
    schema = body.response_format.json_schema.schema_
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return schema_error(schema, value) is None
