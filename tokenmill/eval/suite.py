"""Task suites: JSONL files of tasks, each with what an automatic checker needs.

One JSON object per line (blank lines and lines starting with `#` are skipped); the
format is documented in docs/evals.md. Every task has `id` (unique in the suite), `kind`
and either `prompt` (one user message) or `messages` (a chat), optionally `system` and
`max_tokens`; then by kind:

- `code`: `entry_point` (the function the answer must define) and `tests` (Python that
  raises when the answer is wrong, run after the answer in the sandbox);
- `json`: `schema` (a JSON Schema the answer's JSON must satisfy) and `expected` (fields
  whose values must match);
- `short`: `answer`, one string or a list of accepted strings.

The suites shipped with tokenmill live in tokenmill/eval/suites/ and are named by their
file stem (`code`, `json`, `short`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

Kind = Literal["code", "json", "short"]
KINDS = ("code", "json", "short")
DEFAULT_MAX_TOKENS = {"code": 384, "json": 160, "short": 24}
_COMMON = {"id", "kind", "prompt", "messages", "system", "max_tokens"}
_BY_KIND = {"code": {"entry_point", "tests"}, "json": {"schema", "expected"}, "short": {"answer"}}


class SuiteError(ValueError):
    """A suite that cannot be read: the message names the file, line and field."""


@dataclass(frozen=True)
class Task:
    id: str
    kind: Kind
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    entry_point: Optional[str] = None
    tests: Optional[str] = None
    schema: Optional[dict[str, Any]] = None
    expected: Optional[dict[str, Any]] = None
    answers: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Suite:
    name: str
    source: str  # the file it came from
    tasks: tuple[Task, ...]


def shipped_suites() -> list[str]:
    folder = resources.files("tokenmill.eval") / "suites"
    return sorted(f.name.removesuffix(".jsonl") for f in folder.iterdir() if f.name.endswith(".jsonl"))


def load_suite(name_or_path: str) -> Suite:
    """A shipped suite by name, or any JSONL file in the same format."""
    path = Path(name_or_path)
    if path.suffix == ".jsonl" or path.exists():
        if not path.is_file():
            raise SuiteError(f"suite file {path} does not exist")
        return parse_suite(path.read_text(encoding="utf-8"), source=str(path), name=path.stem)
    if name_or_path not in shipped_suites():
        raise SuiteError(f"no suite named {name_or_path!r} (shipped: {', '.join(shipped_suites())}; "
                         "or give the path of a .jsonl file)")
    text = (resources.files("tokenmill.eval") / "suites" / f"{name_or_path}.jsonl").read_text(encoding="utf-8")
    return Suite(name=name_or_path, source=f"tokenmill/eval/suites/{name_or_path}.jsonl",
                 tasks=parse_suite(text, source=name_or_path, name=name_or_path).tasks)


def parse_suite(text: str, source: str, name: str) -> Suite:
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{where}: not JSON ({exc.msg})") from None
        task = parse_task(obj, where)
        if task.id in seen:
            raise SuiteError(f"{where}: task id {task.id!r} appears twice")
        seen.add(task.id)
        tasks.append(task)
    if not tasks:
        raise SuiteError(f"{source}: no tasks")
    return Suite(name=name, source=source, tasks=tuple(tasks))


def parse_task(obj: Any, where: str) -> Task:
    if not isinstance(obj, dict):
        raise SuiteError(f"{where}: a task must be a JSON object")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise SuiteError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    unknown = set(obj) - _COMMON - _BY_KIND[kind]
    if unknown:
        raise SuiteError(f"{where}: unknown field(s) for a {kind} task: {', '.join(sorted(unknown))}")
    missing = ({"id"} | _BY_KIND[kind]) - set(obj)
    if missing:
        raise SuiteError(f"{where}: missing field(s): {', '.join(sorted(missing))}")
    task_id = obj["id"]
    if not isinstance(task_id, str) or not task_id:
        raise SuiteError(f"{where}: 'id' must be a non-empty string")
    where = f"{where} (task {task_id})"
    messages = _messages(obj, where)
    max_tokens = obj.get("max_tokens", DEFAULT_MAX_TOKENS[kind])
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SuiteError(f"{where}: 'max_tokens' must be a positive integer")
    common = dict(id=task_id, kind=kind, messages=messages, max_tokens=max_tokens, raw=obj)
    if kind == "code":
        entry, tests = obj["entry_point"], obj["tests"]
        if not isinstance(entry, str) or not entry.isidentifier():
            raise SuiteError(f"{where}: 'entry_point' must be a Python identifier")
        if not isinstance(tests, str) or not tests.strip():
            raise SuiteError(f"{where}: 'tests' must be Python source")
        try:
            compile(tests, f"{task_id}/tests", "exec")
        except SyntaxError as exc:
            raise SuiteError(f"{where}: 'tests' does not compile: {exc}") from None
        return Task(**common, entry_point=entry, tests=tests)
    if kind == "json":
        schema, expected = obj["schema"], obj["expected"]
        if not isinstance(schema, dict) or not isinstance(expected, dict):
            raise SuiteError(f"{where}: 'schema' and 'expected' must be JSON objects")
        _check_schema(schema, where)
        return Task(**common, schema=schema, expected=expected)
    answers = obj["answer"] if isinstance(obj["answer"], list) else [obj["answer"]]
    if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise SuiteError(f"{where}: 'answer' must be a non-empty string or a list of them")
    return Task(**common, answers=tuple(answers))


def _messages(obj: dict[str, Any], where: str) -> tuple[dict[str, str], ...]:
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise SuiteError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise SuiteError(f"{where}: 'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        messages = obj["messages"]
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in messages)):
            raise SuiteError(f"{where}: 'messages' must be a list of {{role, content}} objects with string values")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    system = obj.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise SuiteError(f"{where}: 'system' must be a string")
        messages = [{"role": "system", "content": system}, *messages]
    return tuple(messages)


def _check_schema(schema: dict[str, Any], where: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SuiteError(f"{where}: 'schema' is not a valid JSON Schema: {exc.message}") from None
