"""Speculative decoding through the HTTP API: `serve --speculative suffix` answers as it
does with a request's speculation turned off (`speculative: false`), reports drafts in
usage.speculative (full and streamed responses, both endpoints) and in /metrics."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, metric

PASSAGE = ("The lighthouse keeper climbs the stairs at dusk. He cleans the lens, trims the wick and "
           "writes the weather in the log. The lighthouse keeper climbs the stairs at dawn. He cleans "
           "the lens, trims the wick and writes the weather in the log.")


@pytest.fixture(scope="module")
def spec_server():
    srv = ServerProcess("--speculative", "suffix", "--num-speculative-tokens", "6", "--no-batch-api").wait_ready()
    yield srv
    srv.stop()


def _chat(url: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}],
            "max_tokens": 64, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_answers_equal_with_and_without_drafts_and_usage_counts_them(spec_server):
    before = metric(spec_server, "tokenmill_spec_draft_tokens_total")
    on = _chat(spec_server.url)
    off = _chat(spec_server.url, speculative=False)
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    assert "speculative" not in off["usage"]
    spec = on["usage"]["speculative"]
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["accepted_tokens"] < on["usage"]["completion_tokens"]
    after = metric(spec_server, "tokenmill_spec_draft_tokens_total")
    assert after - before == spec["draft_tokens"]
    assert metric(spec_server, "tokenmill_spec_accepted_tokens_total") >= spec["accepted_tokens"]
    assert metric(spec_server, "tokenmill_spec_mean_accepted_length") > 1.0

    # sampled with a seed: the same answer with and without drafts
    seeded = dict(temperature=0.8, seed=5)
    assert (_chat(spec_server.url, **seeded)["choices"][0]["message"]["content"]
            == _chat(spec_server.url, speculative=False, **seeded)["choices"][0]["message"]["content"])


@pytest.mark.slow
def test_streamed_and_completion_usage_report_drafts(spec_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}],
            "max_tokens": 48, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    text = ""
    import json

    with httpx.stream("POST", spec_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    text += c["delta"].get("content") or ""
    assert usage is not None and usage["speculative"]["draft_tokens"] > 0
    assert text == _chat(spec_server.url, max_tokens=48, speculative=False)["choices"][0]["message"]["content"]

    prompt = PASSAGE + " " + PASSAGE
    r = httpx.post(spec_server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "n": 2},
                   timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == out["choices"][1]["text"]
    if "speculative" in out["usage"]:
        assert out["usage"]["speculative"]["accepted_tokens"] <= out["usage"]["speculative"]["draft_tokens"]


def test_bad_speculative_values_are_refused(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "speculative": "yes"},
                   timeout=30)
    assert r.status_code == 400
    assert "speculative" in r.text
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--speculative", "eagle"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "speculative method must be one of off, ngram, suffix" in done.stderr
