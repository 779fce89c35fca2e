"""`tokenmill eval` end to end against a live server of the embedded model.

The same tasks are asked again through the official openai SDK and judged by calling the
checkers directly: the eval must report the same answers, the same verdicts and the same
success count, and price them as the rate card and the machine time say.
"""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal

import pytest

from tests.server.conftest import ServerProcess
from tokenmill.cost import find_card, load_cards, price, with_machine
from tokenmill.eval.checkers import check
from tokenmill.eval.sandbox import Limits, Sandbox
from tokenmill.eval.suite import load_suite

SYSTEM = "Answer with only the answer: a single word, number or name."
EXAMPLE = [{"role": "user", "content": "What is the capital of Italy?"}, {"role": "assistant", "content": "Rome"}]
TASKS = [
    {"id": "france", "kind": "short", "system": SYSTEM, "max_tokens": 8,
     "messages": EXAMPLE + [{"role": "user", "content": "What is the capital of France?"}], "answer": "Paris"},
    {"id": "sum", "kind": "short", "system": SYSTEM, "max_tokens": 8,
     "messages": EXAMPLE + [{"role": "user", "content": "What is 2 + 3?"}], "answer": ["5", "five"]},
    {"id": "person", "kind": "json", "max_tokens": 40,
     "prompt": "Extract the person's name and age from this sentence as a JSON object with keys \"name\" (string) "
               "and \"age\" (integer): \"Maria Lopez is 34 years old.\" Reply with only the JSON object.",
     "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]},
     "expected": {"name": "Maria Lopez", "age": 34}},
    {"id": "city", "kind": "json", "max_tokens": 40,
     "prompt": "Extract the city and country from this sentence as a JSON object with keys \"city\" and "
               "\"country\" (strings): \"The conference takes place in Lyon, France.\" Reply with only the JSON object.",
     "schema": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"]},
     "expected": {"city": "Lyon", "country": "France"}},
    {"id": "add", "kind": "code", "max_tokens": 48, "entry_point": "add",
     "prompt": "Write a Python function `add(a, b)` that returns the sum of a and b. Reply with only the code, "
               "in one ```python block.",
     "tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"},
    {"id": "square", "kind": "code", "max_tokens": 48, "entry_point": "square",
     "prompt": "Write a Python function `square(x)` that returns x multiplied by itself. Reply with only the code, "
               "in one ```python block.",
     "tests": "assert square(3) == 9\nassert square(-2) == 4\n"},
]
USD_PER_HOUR = 3.6


@pytest.fixture(scope="module")
def server():
    # float32: the exact mode, so the SDK's second asking gets the very same answers
    srv = ServerProcess("--max-num-seqs", "8", "--dtype", "float32", "--quantization", "none",
                        "--no-batch-api").wait_ready()
    yield srv
    srv.stop()


def test_eval_reports_what_the_checkers_find_in_the_same_answers(server, tmp_path):
    suite_path = tmp_path / "small.jsonl"
    suite_path.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "eval", str(suite_path), "--base-url", server.url,
         "--usd-per-hour", str(USD_PER_HOUR), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())

    # The same tasks through the official SDK, judged by the checkers directly.
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    suite = load_suite(str(suite_path))
    sandbox = Sandbox(Limits(wall_s=10, cpu_s=10))
    texts, verdicts, usages = {}, {}, {}
    for task in suite.tasks:
        resp = client.chat.completions.create(model=results["configs"][0]["model"], messages=list(task.messages),
                                              max_tokens=task.max_tokens, temperature=0)
        texts[task.id] = resp.choices[0].message.content
        verdicts[task.id] = check(task, texts[task.id], sandbox).passed
        usages[task.id] = resp.usage
    direct = sum(verdicts.values())
    assert 0 < direct < len(TASKS), verdicts  # the suite tells passing from failing answers

    # our model has no card of its own: the self-hosted one, priced at this machine's rate
    assert find_card(load_cards(), results["configs"][0]["model"]) is None
    card = with_machine(load_cards()["tokenmill-default"], usd_per_hour=USD_PER_HOUR)
    assert results["configs"][0]["card"] == card.name
    (config,), (answers,) = results["configs"], results["answers"]
    got = {a["task_id"]: a for a in answers["answers"]}
    assert {k: a["text"] for k, a in got.items()} == texts
    assert {k: a["passed"] for k, a in got.items()} == verdicts
    assert {k: (a["prompt_tokens"], a["completion_tokens"]) for k, a in got.items()} == {
        k: (u.prompt_tokens, u.completion_tokens) for k, u in usages.items()}
    assert config["passed"] == direct and config["tasks"] == len(TASKS)
    assert config["check_errors"] == 0 and config["request_errors"] == 0
    # prefix-cache hits depend on what ran before, so they are the eval's own
    card_usd = sum((price(card, input_tokens=a["prompt_tokens"], cached_tokens=a["cached_tokens"],
                          output_tokens=a["completion_tokens"]).total_usd for a in got.values()), Decimal(0))
    lo, hi = config["success_ci95"]
    assert lo < direct / len(TASKS) < hi
    assert config["card_usd_per_success"] == pytest.approx(float(card_usd / direct), rel=1e-9)
    assert config["machine_usd_per_success"] == pytest.approx(
        USD_PER_HOUR * config["machine_s"] / 3600 / direct, rel=1e-9)
    assert config["latency_s"]["p50"] > 0 and config["machine_s"] > 0
    assert f"{direct}/{len(TASKS)}" in proc.stdout  # the table on stdout


def test_compare_runs_each_configuration_on_the_same_suite(server, tmp_path):
    suite_path = tmp_path / "one.jsonl"
    suite_path.write_text(json.dumps({**TASKS[0], "max_tokens": 4}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "eval", str(suite_path), "--compare",
         f"first={server.url},second={server.url}/v1", "--card", "gpt-5.6-sol", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert [c["label"] for c in results["configs"]] == ["first", "second"]
    first, second = results["configs"]
    assert first["passed"] == second["passed"] == 1  # the exact mode answers alike
    assert first["card"] == "gpt-5.6-sol" and first["card_usd_per_success"] > 0
    assert first["machine_usd_per_success"] is None  # no --usd-per-hour given
    assert [a["text"] for a in results["answers"][0]["answers"]] == [a["text"] for a in results["answers"][1]["answers"]]
    report = (out / "report.md").read_text()
    assert "| first |" in report and "| second |" in report and "![success and cost](eval.png)" in report
    assert "--compare" in results["meta"]["command"]
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_refused_before_any_request(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "kind": "short", "prompt": "hi"}\n')
    for args, message in (([str(bad)], "missing field(s): answer"),
                          (["no-such-suite"], "no suite named"),
                          (["short", "--base-url", "ftp://x"], "not an http(s) URL"),
                          (["short", "--compare", "a=http://x,a=http://y"], "share a label"),
                          (["short", "--base-url", "http://127.0.0.1:9"], "cannot list models")):
        proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "eval", *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
