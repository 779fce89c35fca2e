"""Tenants, keys, limits with headers, caps, classes, budgets, idempotency, deadlines."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, add_key, metric

RL_HEADERS = ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
              "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    db = tmp_path_factory.mktemp("keys") / "keys.db"
    keys = {
        "plain": add_key(db, "plain", "--rpm", "1000", "--tpm", "100000"),
        "rpm": add_key(db, "rpm", "--rpm", "3", "--tpm", "100000"),
        "conc": add_key(db, "conc", "--max-concurrency", "1"),
        "caps": add_key(db, "caps", "--max-prompt-tokens", "60", "--max-output-tokens", "5", "--max-n", "2"),
        "work": add_key(db, "work", "--max-work-tokens", "45"),
        "tpm": add_key(db, "tpm", "--tpm", "200", "--rpm", "100"),
        "budget": add_key(db, "budget", "--budget-usd", "0.000000001"),
        "batchonly": add_key(db, "batchonly", "--class", "batch", "--batch-only"),
        "revoked": add_key(db, "gone"),
    }
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "keys", "revoke", "--tenant", "gone", "--db", str(db)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "revoked 1" in r.stdout
    listing = subprocess.run([sys.executable, "-m", "tokenmill.cli", "keys", "list", "--db", str(db)],
                             capture_output=True, text=True, timeout=60).stdout
    assert keys["plain"] not in listing and "tenant=plain" in listing  # only prefixes are listed
    srv = ServerProcess("--keys-db", str(db), "--log-level", "info").wait_ready()
    yield srv, keys
    srv.stop()


def chat(srv, key, headers=None, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0,
            **kw}
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers={**h, **(headers or {})}, timeout=120)


def test_bad_missing_revoked_keys_are_401_with_one_message(keyed):
    srv, keys = keyed
    messages = set()
    for key in (None, "tm-not-a-real-key", keys["revoked"], ""):
        r = chat(srv, key)
        assert r.status_code == 401
        messages.add(r.json()["error"]["message"])
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": "Basic abc"}, json={})
    assert r.status_code == 401
    messages.add(r.json()["error"]["message"])
    assert len(messages) == 1
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/health").status_code == 200  # health stays open


def test_headers_on_success(keyed):
    srv, keys = keyed
    r = chat(srv, keys["plain"])
    assert r.status_code == 200
    for h in RL_HEADERS:
        assert h in r.headers, h
    assert r.headers["x-ratelimit-limit-requests"] == "1000"
    assert int(r.headers["x-ratelimit-remaining-requests"]) <= 1000  # refills ~17/s: exact drop is timing
    assert r.headers["x-ratelimit-limit-tokens"] == "100000"


def test_requests_per_minute(keyed):
    srv, keys = keyed
    rs = [chat(srv, keys["rpm"]) for _ in range(3)]
    assert [r.status_code for r in rs] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in rs] == ["2", "1", "0"]
    r = chat(srv, keys["rpm"])
    assert r.status_code == 429
    e = r.json()["error"]
    assert e["type"] == "rate_limit_error" and e["code"] == "rate_limit_exceeded" and "requests per minute" in e["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 20
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-limit-requests"] == "3"


def test_concurrency(keyed):
    srv, keys = keyed
    started = threading.Event()
    done = []

    def long_stream():
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {keys['conc']}"}) as resp:
            for line in resp.iter_lines():
                started.set()
            done.append(resp.status_code)

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    r = chat(srv, keys["conc"])
    assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
    t.join(120)
    assert done == [200]
    assert chat(srv, keys["conc"]).status_code == 200  # the slot was released


def test_prompt_output_and_n_caps(keyed):
    srv, keys = keyed
    before = metric(srv, 'tokenmill_work_cap_hits_total{cap="output"}') if _has(srv, "output") else 0
    r = chat(srv, keys["caps"], max_tokens=100, ignore_eos=True)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
    r = chat(srv, keys["caps"], messages=[{"role": "user", "content": "word " * 80}])
    assert r.status_code == 429 and r.json()["error"]["code"] == "prompt_cap_exceeded"
    r = chat(srv, keys["caps"], n=3)
    assert r.status_code == 429 and r.json()["error"]["param"] == "n"
    assert metric(srv, 'tokenmill_work_cap_hits_total{cap="output"}') == before + 1
    assert metric(srv, 'tokenmill_work_cap_hits_total{cap="prompt"}') >= 1


def _has(srv, cap):
    return f'tokenmill_work_cap_hits_total{{cap="{cap}"}}' in httpx.get(srv.url + "/metrics").text


def test_work_cap_clamps_output(keyed):
    srv, keys = keyed
    r = chat(srv, keys["work"], max_tokens=100, ignore_eos=True)
    u = r.json()["usage"]
    assert r.status_code == 200 and u["prompt_tokens"] + u["completion_tokens"] == 45
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = chat(srv, keys["work"], messages=[{"role": "user", "content": "word " * 40}])
    assert r.status_code == 429 and r.json()["error"]["code"] == "work_cap_exceeded"


def test_tokens_per_minute_reserves_output(keyed):
    srv, keys = keyed
    r = chat(srv, keys["tpm"], max_tokens=300)
    assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
    r = chat(srv, keys["tpm"], max_tokens=100)  # reserves prompt + 100, settles to what was used
    assert r.status_code == 200
    used = r.json()["usage"]["total_tokens"]
    remaining = int(chat(srv, keys["tpm"], max_tokens=1).headers["x-ratelimit-remaining-tokens"])
    assert remaining >= 200 - used - 40 - 5  # the unused reservation came back (second request used ~40)


def test_a_key_without_a_tpm_limit_gets_the_servers_token_headers(keyed):
    srv, keys = keyed
    tpm, conc = chat(srv, keys["tpm"]).headers, chat(srv, keys["conc"]).headers  # conc: no TPM, no RPM
    assert tpm["x-ratelimit-limit-tokens"] == "200"  # the key's own
    assert int(conc["x-ratelimit-limit-tokens"]) > 200  # the server's capacity (its KV cache at least)
    assert 0 <= int(conc["x-ratelimit-remaining-tokens"]) < int(conc["x-ratelimit-limit-tokens"])
    assert "x-ratelimit-reset-tokens" in conc and "x-ratelimit-limit-requests" not in conc


def test_spend_budget(keyed):
    srv, keys = keyed
    r = chat(srv, keys["budget"])
    assert r.status_code == 200 and r.json()["usage"]["cost"]["total_usd"] > 0
    r = chat(srv, keys["budget"])
    assert r.status_code == 429 and r.json()["error"]["code"] == "spend_budget_exceeded"
    assert int(r.headers["Retry-After"]) >= 1


def test_request_classes(keyed):
    srv, keys = keyed
    assert chat(srv, keys["batchonly"]).status_code == 200  # tenant default: batch
    r = chat(srv, keys["batchonly"], priority="interactive")
    assert r.status_code == 403
    assert chat(srv, keys["plain"], priority="batch").status_code == 200


def test_idempotent_retry_generates_once(keyed):
    srv, keys = keyed
    h = {"Idempotency-Key": "order-42"}
    before = metric(srv, "tokenmill_generation_tokens_total")
    a = chat(srv, keys["plain"], headers=h, temperature=1.0, max_tokens=12)
    b = chat(srv, keys["plain"], headers=h, temperature=1.0, max_tokens=12)
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json() and b.headers.get("idempotent-replayed") == "true"
    assert metric(srv, "tokenmill_generation_tokens_total") == before + a.json()["usage"]["completion_tokens"]
    c = chat(srv, keys["plain"], headers=h, temperature=1.0, max_tokens=13)
    assert c.status_code == 422
    # another tenant's identical key is its own
    d = chat(srv, keys["tpm"], headers=h, max_tokens=2)
    assert d.status_code == 200 and d.json()["id"] != a.json()["id"]


def test_deadline_aborts_and_frees(keyed):
    srv, keys = keyed
    r = chat(srv, keys["plain"], headers={"X-Request-Timeout": "0.5"}, max_tokens=3000, ignore_eos=True)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(srv, "tokenmill_kv_blocks_used") > 0:
        time.sleep(0.1)
    assert metric(srv, "tokenmill_kv_blocks_used") == 0
    assert chat(srv, keys["plain"], headers={"X-Request-Timeout": "soon"}).status_code == 400


def test_keys_never_logged(keyed):
    srv, keys = keyed
    chat(srv, keys["plain"])
    chat(srv, "tm-wrong-key-value")
    out = srv.stop()
    assert out  # the server did log
    for k in keys.values():
        assert k not in out
    assert "tm-wrong-key-value" not in out
