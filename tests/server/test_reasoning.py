"""Reasoning on a real server (the embedded model, float32) with a test chat template that
opens a thinking block (tests/data/chatml_thinking.jinja, so the qwen3 parser is chosen
from it): the thinking budget closes the block in the engine, reasoning_tokens counted in
usage (full and streamed) and /metrics, the answer non-empty, a budget with
response_format, chat_template_kwargs' enable_thinking, bad budgets refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess

TEMPLATE = str(Path(__file__).parent.parent / "data" / "chatml_thinking.jinja")
ASK = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


@pytest.fixture(scope="module")
def thinker():
    srv = ServerProcess("--dtype", "float32", "--quantization", "none", "--chat-template", TEMPLATE).wait_ready()
    yield srv
    srv.stop()


def chat(srv, **body):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "temperature": 0, **body}, timeout=300)
    return r


@pytest.mark.parametrize("budget", [5, 12])
def test_the_budget_closes_the_thinking_and_the_answer_comes(thinker, budget):
    r = chat(thinker, max_tokens=24, thinking_token_budget=budget)
    assert r.status_code == 200, r.text
    body = r.json()
    msg, usage = body["choices"][0]["message"], body["usage"]
    reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning <= budget
    assert msg["reasoning_content"] and msg["content"]  # the block closed, the answer came
    assert usage["completion_tokens"] > reasoning


def test_streamed_and_whole_agree(thinker):
    whole = chat(thinker, max_tokens=24, thinking_token_budget=10).json()
    with httpx.stream("POST", thinker.url + "/v1/chat/completions", timeout=300,
                      json={"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 24, "thinking_token_budget": 10,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    msg = whole["choices"][0]["message"]
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    assert chunks[-1]["usage"]["completion_tokens_details"] == whole["usage"]["completion_tokens_details"]


def test_reasoning_counts_toward_max_tokens_and_never_closing_is_all_reasoning(thinker):
    r = chat(thinker, max_tokens=10).json()  # no budget: it thinks past max_tokens
    msg, usage = r["choices"][0]["message"], r["usage"]
    assert r["choices"][0]["finish_reason"] == "length" and usage["completion_tokens"] == 10
    if "</think>" not in (msg["reasoning_content"] or ""):
        assert msg["content"] is None and usage["completion_tokens_details"]["reasoning_tokens"] == 10


def test_the_budget_composes_with_response_format(thinker):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    r = chat(thinker, max_tokens=60, thinking_token_budget=16,
             response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert r.status_code == 200, r.text
    body = r.json()
    msg = body["choices"][0]["message"]
    assert 0 < body["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 16
    assert msg["reasoning_content"]
    assert isinstance(json.loads(msg["content"])["city"], str)  # the grammar held the answer alone


def test_an_explicit_budget_wins_over_reasoning_effort(thinker):
    r = chat(thinker, max_tokens=24, thinking_token_budget=6, reasoning_effort="high").json()
    assert 0 < r["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 6
    assert chat(thinker, reasoning_effort="extreme").status_code == 400


def test_enable_thinking_false_answers_without_thinking(thinker):
    r = chat(thinker, max_tokens=16, chat_template_kwargs={"enable_thinking": False}).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"]
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_bad_budgets_are_refused(thinker):
    for budget, param in ((0, "thinking_token_budget"), (2, "thinking_token_budget")):
        r = chat(thinker, max_tokens=8, thinking_token_budget=budget)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = chat(thinker, max_tokens=8, chat_template_kwargs={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_metrics_count_reasoning_tokens(thinker):
    def counted() -> float:
        text = httpx.get(thinker.url + "/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("tokenmill_reasoning_tokens_total"))

    before = counted()
    r = chat(thinker, max_tokens=16, thinking_token_budget=8).json()
    assert counted() - before == r["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_a_server_without_a_thinking_template_refuses_a_budget(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, "thinking_token_budget": 50})
    assert r.status_code == 400 and "thinking model" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": ASK, "max_tokens": 4, "reasoning_effort": "low"}).json()
    assert "reasoning_content" not in ok["choices"][0]["message"]
    assert "completion_tokens_details" not in ok["usage"]


def test_the_batch_api_counts_reasoning_tokens(thinker):
    from tests.server.test_batch_api import _records, _submit, _wait

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    line = {"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 12,
                     "thinking_token_budget": 6}}
    b = _wait(client, _submit(client, [line]).id)
    assert b.status == "completed"
    [record] = _records(client, b.output_file_id)
    usage = record["response"]["body"]["usage"]
    reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning <= 6
    assert b.usage.output_tokens_details.reasoning_tokens == reasoning
