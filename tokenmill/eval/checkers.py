"""Automatic checkers: one answer text in, pass or fail (with the reason) out.

- short answers: the reply equals an accepted answer after `normalize` (whitespace runs
  become one space, case folded, and the quotes, backticks, asterisks and final
  punctuation a chat model wraps a bare answer in are dropped);
- JSON extraction: the reply's JSON (the whole reply, else its first fenced block, else
  the first object in it) validates against the task's JSON Schema, and every field of
  `expected` equals the answer's (strings compared as short answers are; numbers,
  booleans and null exactly; lists and objects element by element);
- code: the reply's code (its first fenced Python block that defines the entry point,
  else its first Python or unlabeled block, else the whole reply) and then the task's
  tests run in the sandbox; the task passes only if the tests run to their end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.eval.sandbox import Sandbox
from tokenmill.eval.suite import Task

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_WRAPPING = " \t\n\"'`*_.!?,;:"
_PY_LANGS = ("python", "py", "python3", "")


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str
    error: bool = False  # the checker could not judge (the sandbox failed), not a wrong answer


def normalize(text: str) -> str:
    return " ".join(text.split()).casefold().strip(_WRAPPING)


def check_short(task: Task, text: str) -> Verdict:
    got = normalize(text)
    if any(got == normalize(a) for a in task.answers):
        return Verdict(True, "matches")
    return Verdict(False, f"got {got[:80]!r}, expected {' or '.join(repr(a) for a in task.answers)}")


def extract_json(text: str) -> Any:
    """The JSON value a reply carries; raises ValueError when it carries none."""
    candidates = [text.strip()] + [body.strip() for lang, body in _FENCE.findall(text)]
    for c in candidates:
        try:
            return json.loads(c)
        except ValueError:
            continue
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[{\[]", text):
        try:
            return decoder.raw_decode(text, match.start())[0]
        except ValueError:
            continue
    raise ValueError("no JSON in the reply")


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, str):
        return isinstance(got, str) and normalize(expected) == normalize(got)
    if isinstance(expected, bool) or expected is None:
        return got is expected
    if isinstance(expected, (int, float)):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and got == expected
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(_same, expected, got))
    if isinstance(expected, dict):
        return isinstance(got, dict) and expected.keys() == got.keys() and all(
            _same(v, got[k]) for k, v in expected.items())
    return False


def schema_error(schema: dict[str, Any], value: Any) -> str | None:
    """Why `value` does not validate against the JSON Schema (its draft as it declares),
    or None when it does. Also the server's check of answers to a json_schema or a tool."""
    import jsonschema

    errors = jsonschema.validators.validator_for(schema)(schema).iter_errors(value)
    first = jsonschema.exceptions.best_match(errors)
    if first is None:
        return None
    where = "/".join(str(p) for p in first.path) or "the value"
    return f"{where}: {first.message[:160]}"


def check_json(task: Task, text: str) -> Verdict:
    assert task.schema is not None and task.expected is not None
    try:
        value = extract_json(text)
    except ValueError as exc:
        return Verdict(False, str(exc))
    error = schema_error(task.schema, value)
    if error is not None:
        return Verdict(False, f"schema: {error}")
    if not isinstance(value, dict):
        return Verdict(False, "the JSON is not an object")
    wrong = [k for k, v in task.expected.items() if k not in value or not _same(v, value[k])]
    if wrong:
        k = wrong[0]
        return Verdict(False, f"field {k!r}: got {json.dumps(value.get(k))[:60]}, expected "
                              f"{json.dumps(task.expected[k])[:60]}")
    return Verdict(True, "schema and fields match")


def extract_code(text: str, entry_point: Optional[str] = None) -> str:
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    py = [body for lang, body in blocks if lang in _PY_LANGS]
    if entry_point:
        defines = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
        for body in py:
            if defines.search(body):
                return body
    if py:
        return py[0]
    return text


def check_code(task: Task, text: str, sandbox: Sandbox) -> Verdict:
    assert task.tests is not None
    result = sandbox.run(extract_code(text, task.entry_point), task.tests)
    return Verdict(result.passed, result.reason, error=result.error is not None)


def check(task: Task, text: str, sandbox: Sandbox) -> Verdict:
    if task.kind == "code":
        return check_code(task, text, sandbox)
    if task.kind == "json":
        return check_json(task, text)
    return check_short(task, text)
