"""The model's own generation defaults and the server's default output cap, for requests
that say nothing (issue: the README's first request streamed 8,000 tokens of noise)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess


@pytest.fixture(scope="module")
def default_server():
    srv = ServerProcess("--no-batch-api").wait_ready()  # the default mode, as `make serve` runs
    yield srv
    srv.stop()


def _chat(srv, **body) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_the_readme_request_ends_with_stop_in_a_few_dozen_tokens(default_server):
    models = httpx.get(default_server.url + "/v1/models").json()["data"][0]
    # SmolLM2-135M-Instruct's model card samples at 0.2 / 0.9; silent requests are capped
    assert models["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 2048}
    for seed in (1, 2, 3):  # (seeded so the test is repeatable; the defaults are what is tested)
        body = _chat(default_server, seed=seed)
        assert body["choices"][0]["finish_reason"] == "stop", body
        assert 0 < body["usage"]["completion_tokens"] < 64, body["usage"]


@pytest.mark.slow
def test_the_client_overrides_the_defaults_and_max_tokens_binds(default_server):
    at_one = [_chat(default_server, temperature=1.0, seed=s, max_tokens=24, ignore_eos=True)
              for s in range(4)]
    assert all(b["usage"]["completion_tokens"] == 24 for b in at_one)
    assert len({b["choices"][0]["message"]["content"] for b in at_one}) > 1  # temperature 1 was applied


@pytest.mark.slow
def test_an_operator_generation_config_and_default_cap(tmp_path):
    cfg = tmp_path / "generation_config.json"
    cfg.write_text(json.dumps({"do_sample": False, "max_new_tokens": 7}))
    srv = ServerProcess("--no-batch-api", "--dtype", "float32", "--generation-config", str(cfg),
                        "--default-max-tokens", "100").wait_ready()
    try:
        models = httpx.get(srv.url + "/v1/models").json()["data"][0]
        assert models["generation_defaults"] == {"temperature": 0.0, "max_tokens": 7}
        a, b = (_chat(srv, ignore_eos=True) for _ in range(2))
        assert a["usage"]["completion_tokens"] == 7 and a["choices"][0]["finish_reason"] == "length"
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]  # greedy
        assert _chat(srv, max_tokens=9, ignore_eos=True)["usage"]["completion_tokens"] == 9
    finally:
        srv.stop()


def test_a_bad_generation_config_stops_the_server_with_a_clear_message(tmp_path):
    bad = tmp_path / "gen.json"
    bad.write_text(json.dumps({"temperature": -3}))
    srv = ServerProcess("--no-batch-api", "--generation-config", str(bad))
    code = srv.proc.wait(timeout=120)
    out = srv.stop()
    assert code != 0 and "generation defaults" in out and "temperature" in out, out
