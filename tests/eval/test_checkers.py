"""The checkers and the suite format: each rule judged on hand-written answers."""

from __future__ import annotations

import json

import pytest

from tokenmill.eval.checkers import check, check_json, check_short, extract_code, extract_json, normalize
from tokenmill.eval.sandbox import Limits, Sandbox
from tokenmill.eval.suite import SuiteError, load_suite, parse_suite, parse_task, shipped_suites


def task(**fields):
    return parse_task(fields, "test")


SHORT = task(id="s", kind="short", prompt="Capital of France?", answer=["Paris", "Paris, France"])
JSON = task(id="j", kind="json", prompt="extract",
            schema={"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                      "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["name", "age"]},
            expected={"name": "Ada Lovelace", "age": 36})
CODE = task(id="c", kind="code", prompt="write add", entry_point="add", tests="assert add(2, 3) == 5\n")


@pytest.mark.parametrize("reply,ok", [
    ("Paris", True), ("  paris.  ", True), ("**Paris**", True), ('"Paris"', True), ("PARIS\n", True),
    ("Paris,  France", True), ("Paris is the capital", False), ("Lyon", False), ("", False),
])
def test_short_answers_match_exactly_after_normalising(reply, ok):
    assert check_short(SHORT, reply).passed is ok


def test_normalize_keeps_inner_punctuation():
    assert normalize("  H2O  ") == "h2o" and normalize("e.g.  this") == "e.g. this"


@pytest.mark.parametrize("reply,ok,reason", [
    ('{"name": "Ada Lovelace", "age": 36}', True, "match"),
    ('Here you go:\n```json\n{"name": "ada  lovelace", "age": 36, "tags": []}\n```', True, "match"),
    ('Sure! {"name": "Ada Lovelace", "age": 36} hope that helps', True, "match"),
    ('{"name": "Ada Lovelace", "age": "36"}', False, "schema"),  # a string is not an integer
    ('{"name": "Ada Lovelace"}', False, "schema"),  # required field missing
    ('{"name": "Ada Lovelace", "age": 35}', False, "field 'age'"),
    ('{"name": "Ada Lovelace", "age": 36.5}', False, "schema"),
    ('{"name": "Ada Lovelace", "age": true}', False, "schema"),  # a boolean is not an integer
    ("no json here", False, "no JSON"),
    ('{"name": "Ada Lovelace", "age": 36, "tags": [1]}', False, "schema"),
])
def test_json_answers_are_checked_against_schema_and_fields(reply, ok, reason):
    v = check_json(JSON, reply)
    assert v.passed is ok and reason in v.reason, v


def test_json_expected_values_compare_by_type():
    t = task(id="b", kind="json", prompt="x", schema={"type": "object"}, expected={"flag": True, "n": 1})
    assert check_json(t, '{"flag": true, "n": 1.0}').passed
    assert not check_json(t, '{"flag": 1, "n": 1}').passed  # 1 is not true
    assert not check_json(t, '{"flag": true, "n": true}').passed  # true is not 1


def test_extract_json_prefers_the_whole_reply_then_a_fence():
    assert extract_json("[1, 2]") == [1, 2]
    assert extract_json("x\n```\n{\"a\": 1}\n```") == {"a": 1}
    with pytest.raises(ValueError):
        extract_json("{not json")


def test_extract_code_picks_the_block_defining_the_entry_point():
    reply = ("Example:\n```python\nprint(add(1, 2))\n```\nSolution:\n```python\ndef add(a, b):\n"
             "    return a + b\n```\n")
    assert extract_code(reply, "add").startswith("def add")
    assert extract_code("```\ndef f():\n  pass\n```", "g") == "def f():\n  pass\n"
    assert extract_code("def add(a, b): return a + b", "add") == "def add(a, b): return a + b"
    # a block cut off by max_tokens still counts
    assert extract_code("```python\ndef add(a, b):\n    return a + b\n", "add").startswith("def add")
    assert extract_code("```js\nfunction add(){}\n```\n```python\ndef add(): pass\n```", "add") == "def add(): pass\n"


def test_code_answers_pass_only_when_their_tests_run_to_the_end():
    sb = Sandbox(Limits(wall_s=5, cpu_s=4))
    assert check(CODE, "```python\ndef add(a, b):\n    return a + b\n```", sb).passed
    wrong = check(CODE, "```python\ndef add(a, b):\n    return a * b\n```", sb)
    assert not wrong.passed and "AssertionError" in wrong.reason and not wrong.error
    missing = check(CODE, "I cannot help with that.", sb)
    assert not missing.passed and "SyntaxError" in missing.reason
    early = check(CODE, "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n```", sb)
    assert not early.passed


def test_shipped_suites_load_and_their_reference_answers_pass():
    assert {"code", "json", "short"} <= set(shipped_suites())
    sb = Sandbox(Limits(wall_s=5, cpu_s=4))
    code = load_suite("code")
    assert len(code.tasks) >= 10
    # every shipped code task can be solved (its tests accept a correct solution) and failed
    for t in code.tasks:
        assert check(t, REFERENCE_SOLUTIONS[t.id], sb).passed, t.id
        assert not check(t, f"def {t.entry_point}(*args):\n    return None\n", sb).passed, t.id
    for t in load_suite("json").tasks:
        assert check_json(t, json.dumps({**UNCHECKED_FIELDS.get(t.id, {}), **t.expected})).passed, t.id
    for t in load_suite("short").tasks:
        assert check_short(t, t.answers[0]).passed


# Required fields that `expected` leaves free (any value of the right type passes).
UNCHECKED_FIELDS = {"order": {"product": "blue notebooks"}}

REFERENCE_SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b\n",
    "square": "def square(x):\n    return x * x\n",
    "is_even": "def is_even(n):\n    return n % 2 == 0\n",
    "max_of_three": "def max_of_three(a, b, c):\n    return max(a, b, c)\n",
    "reverse_string": "def reverse_string(s):\n    return s[::-1]\n",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
    "factorial": "def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n",
    "fibonacci": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "is_palindrome": "def is_palindrome(s):\n    return s == s[::-1]\n",
    "sum_list": "def sum_list(numbers):\n    return sum(numbers)\n",
    "is_prime": "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
    "celsius_to_fahrenheit": "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n",
    "gcd": "import math\ndef gcd(a, b):\n    return math.gcd(a, b)\n",
    "remove_duplicates": "def remove_duplicates(items):\n    return list(dict.fromkeys(items))\n",
    "word_count": "def word_count(text):\n    return len(text.split())\n",
    "fizzbuzz": ("def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else "
                 "'Buzz' if n % 5 == 0 else str(n)\n"),
}


@pytest.mark.parametrize("line,message", [
    ('{"id": "a", "kind": "poem", "prompt": "x"}', "'kind' must be one of"),
    ('{"id": "a", "kind": "short", "prompt": "x"}', "missing field(s): answer"),
    ('{"id": "a", "kind": "short", "prompt": "x", "answer": "y", "extra": 1}', "unknown field(s)"),
    ('{"id": "a", "kind": "short", "answer": "y"}', "exactly one of 'prompt' or 'messages'"),
    ('{"id": "a", "kind": "code", "prompt": "x", "entry_point": "f", "tests": "assert ("}', "does not compile"),
    ('{"id": "a", "kind": "code", "prompt": "x", "entry_point": "1f", "tests": "pass"}', "identifier"),
    ('{"id": "a", "kind": "json", "prompt": "x", "schema": {"type": 5}, "expected": {}}', "not a valid JSON Schema"),
    ('{"id": "a", "kind": "short", "prompt": "x", "answer": "y", "max_tokens": 0}', "max_tokens"),
    ('{"id": "a", "kind": "short", "messages": [{"role": "user"}], "answer": "y"}', "'messages' must be"),
    ("not json", "not JSON"),
])
def test_bad_suites_are_refused_with_the_line_and_field(line, message):
    with pytest.raises(SuiteError) as err:
        parse_suite(line + "\n", source="s.jsonl", name="s")
    assert message in str(err.value) and "s.jsonl:1" in str(err.value)


def test_duplicate_ids_and_empty_suites_are_refused(tmp_path):
    line = '{"id": "a", "kind": "short", "prompt": "x", "answer": "y"}\n'
    with pytest.raises(SuiteError, match="appears twice"):
        parse_suite(line + line, source="s", name="s")
    with pytest.raises(SuiteError, match="no tasks"):
        parse_suite("# only a comment\n\n", source="s", name="s")
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite(str(tmp_path / "missing.jsonl"))
    with pytest.raises(SuiteError, match="no suite named"):
        load_suite("no-such-suite")


def test_a_jsonl_file_with_system_and_messages_loads(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": "q", "kind": "short", "system": "Be brief.", "messages": '
                    '[{"role": "user", "content": "hi"}], "answer": "hello", "max_tokens": 5}\n')
    suite = load_suite(str(path))
    t = suite.tasks[0]
    assert suite.name == "mine" and t.max_tokens == 5
    assert t.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"})
