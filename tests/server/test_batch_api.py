"""The Batch API through the unmodified openai SDK against live servers: answers equal
to live ones, per-line validation, cancel, expiry, tenants, batch prices, and a server
killed (-9) three times mid-batch that still answers every line exactly once."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

FINAL = ("completed", "failed", "cancelled", "expired")


def _jsonl(lines: list[dict]) -> bytes:
    return ("\n".join(json.dumps(x) for x in lines) + "\n").encode()


def _chat_line(i: int, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say something about the number {i}."}],
                     "max_tokens": 4 + i % 9, "temperature": 0, **body}}


def _submit(client, lines: list[dict], endpoint="/v1/chat/completions", window="24h"):
    f = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)


def _wait(client, batch_id: str, until=FINAL, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if (b.status in until if isinstance(until, tuple) else until(b)) or time.monotonic() > deadline:
            return b
        time.sleep(0.3)


def _records(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def test_batch_answers_equal_live_answers(client, server):
    lines = [_chat_line(i) for i in range(200)]
    b = _submit(client, lines)
    assert b.status == "validating" and b.endpoint == "/v1/chat/completions"
    b = _wait(client, b.id)
    assert b.status == "completed", b
    assert b.request_counts.total == 200 and b.request_counts.completed == 200 and b.request_counts.failed == 0
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.error_file_id is None
    out = _records(client, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(x["custom_id"] for x in lines)  # each once
    by_id = {r["custom_id"]: r for r in out}
    assert len({r["id"] for r in out}) == 200
    usage = {"in": 0, "out": 0}
    for line in lines[::7]:  # the same request sent live: the same answer (exact mode, greedy)
        live = client.chat.completions.create(**line["body"])
        rec = by_id[line["custom_id"]]
        assert rec["error"] is None and rec["response"]["status_code"] == 200
        body = rec["response"]["body"]
        assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert body["choices"][0]["finish_reason"] == live.choices[0].finish_reason
        assert body["usage"]["completion_tokens"] == live.usage.completion_tokens
    for r in out:
        usage["in"] += r["response"]["body"]["usage"]["prompt_tokens"]
        usage["out"] += r["response"]["body"]["usage"]["completion_tokens"]
    assert b.usage.input_tokens == usage["in"] and b.usage.output_tokens == usage["out"]
    assert b.usage.total_tokens == usage["in"] + usage["out"]
    # listed, newest first, with a working cursor
    page = client.batches.list(limit=1)
    assert page.data[0].id == b.id
    # the output file is a file of this tenant's, downloadable again
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    text = httpx.get(server.url + "/metrics", timeout=10).text
    ok = [x for x in text.splitlines() if x.startswith('tokenmill_batch_lines_total{outcome="ok"}')]
    assert ok and float(ok[0].rsplit(" ", 1)[1]) >= 200
    assert 'tokenmill_batches{status="completed"}' in text


def test_completions_batch_and_files_api(client):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"The number {i} is", "max_tokens": 5, "temperature": 0}}
             for i in range(6)]
    b = _wait(client, _submit(client, lines, endpoint="/v1/completions").id)
    assert b.status == "completed"
    rec = {r["custom_id"]: r for r in _records(client, b.output_file_id)}
    live = client.completions.create(**lines[2]["body"])
    assert rec["c2"]["response"]["body"]["choices"][0]["text"] == live.choices[0].text
    f = client.files.create(file=("x.jsonl", _jsonl(lines)), purpose="batch")
    assert f.id in [x.id for x in client.files.list().data]
    assert client.files.retrieve(f.id).bytes == len(_jsonl(lines))
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_validation_fails_the_batch_per_line_and_runs_nothing(client, server):
    good = _chat_line(0)
    raw = b"\n".join([
        json.dumps(good).encode(),
        b"{not json",
        json.dumps(good).encode(),  # duplicate custom_id
        json.dumps({**_chat_line(3), "url": "/v1/completions"}).encode(),
        json.dumps({**_chat_line(4), "method": "GET"}).encode(),
        json.dumps(_chat_line(5, temperature="hot")).encode(),
        json.dumps(_chat_line(6, max_tokens=10 ** 7)).encode(),
        json.dumps(_chat_line(7, stream=True)).encode(),
        json.dumps(_chat_line(8, stop=["x"] * 100)).encode(),
        json.dumps({**_chat_line(9), "body": {**_chat_line(9)["body"], "model": "gpt-nope"}}).encode(),
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": good["body"]}).encode(),
    ]) + b"\n"
    f = client.files.create(file=("bad.jsonl", raw), purpose="batch")
    b = _wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.in_progress_at is None
    errs = {e.line: e for e in b.errors.data}
    assert sorted(errs) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert errs[2].code == "invalid_json_line"
    assert errs[3].code == "duplicate_custom_id"
    assert errs[4].code == "mismatched_endpoint" and errs[5].code == "invalid_method"
    assert errs[6].param == "temperature"
    assert errs[7].code == "context_length_exceeded" or errs[7].param == "max_tokens"
    assert errs[8].param == "stream" and errs[9].param == "stop" and errs[10].param == "model"
    assert errs[11].code == "missing_required_parameter"
    assert b.output_file_id is None and b.request_counts.completed == 0
    # refused at once, with the right status: no such file, a bad endpoint or window
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    for kwargs in ({"endpoint": "/v1/embeddings"}, {"completion_window": "forever"},
                   {"metadata": {"k" * 65: "v"}}):
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError):
            client.batches.create(**args)
    r = httpx.post(server.url + "/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "fine-tune"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    with pytest.raises(openai.ConflictError):  # a failed batch cannot be cancelled
        client.batches.cancel(b.id)


def test_cancel_stops_issuing_lines_and_keeps_what_finished(client, server):
    lines = [_chat_line(i, max_tokens=48, ignore_eos=True) for i in range(80)]
    b = _wait(client, _submit(client, lines).id, until=lambda b: b.request_counts.completed >= 3)
    assert b.status == "in_progress"
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at
    b = _wait(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    done = _records(client, b.output_file_id)
    not_run = _records(client, b.error_file_id)
    assert 3 <= len(done) < 80 and len(done) == b.request_counts.completed
    assert sorted(r["custom_id"] for r in done + not_run) == sorted(x["custom_id"] for x in lines)
    assert all(r["error"]["code"] == "batch_cancelled" and r["response"] is None for r in not_run)
    # nothing of the batch is left running in the engine
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(server):
        time.sleep(0.2)
    assert _running(server) == 0


def _running(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
               if x.startswith("tokenmill_num_requests_running"))


def test_expiry_with_a_short_window(client):
    lines = [_chat_line(i, max_tokens=64, ignore_eos=True) for i in range(60)]
    b = _wait(client, _submit(client, lines, window="4s").id)
    assert b.status == "expired" and b.expired_at and b.expires_at - b.created_at == 4
    done = _records(client, b.output_file_id)
    expired = _records(client, b.error_file_id)
    assert len(done) < 60 and len(done) + len(expired) == 60
    assert sorted(r["custom_id"] for r in done + expired) == sorted(x["custom_id"] for x in lines)
    assert all(r["error"]["code"] == "batch_expired" for r in expired)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from tokenmill.server.keys import KeyStore

    db = tmp_path_factory.mktemp("keys") / "keys.db"
    store = KeyStore(db)
    keys = {name: store.add_key(name) for name in ("alice", "bob")}
    store.close()
    srv = ServerProcess("--keys-db", str(db), "--price-card", "gpt-5.6-sol", "--batch-max-lines", "20",
                        "--batch-max-file-mb", "0.05").wait_ready()
    yield srv, keys
    srv.stop()


def test_tenants_see_only_their_own_files_and_batches(keyed):
    srv, keys = keyed
    alice, bob = (openai.OpenAI(base_url=srv.url + "/v1", api_key=keys[k], max_retries=0) for k in ("alice", "bob"))
    b = _wait(alice, _submit(alice, [_chat_line(i) for i in range(4)]).id)
    assert b.status == "completed"
    for call in (lambda: bob.batches.retrieve(b.id), lambda: bob.files.retrieve(b.input_file_id),
                 lambda: bob.files.content(b.output_file_id), lambda: bob.batches.cancel(b.id),
                 lambda: bob.files.delete(b.input_file_id),
                 lambda: bob.batches.create(input_file_id=b.input_file_id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert "no " in exc.value.message  # the same answer as for an id that never existed
    assert bob.batches.list().data == [] and bob.files.list().data == []
    assert [x.id for x in alice.batches.list().data] == [b.id]
    nobody = openai.OpenAI(base_url=srv.url + "/v1", api_key="tm-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nobody.batches.list()


def test_upload_limits(keyed):
    srv, keys = keyed
    alice = openai.OpenAI(base_url=srv.url + "/v1", api_key=keys["alice"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:  # --batch-max-lines 20
        alice.files.create(file=("a.jsonl", _jsonl([_chat_line(i) for i in range(21)])), purpose="batch")
    assert "at most 20 lines" in exc.value.message
    r = httpx.post(srv.url + "/v1/files", headers={"Authorization": f"Bearer {keys['alice']}"},
                   files={"file": ("big.jsonl", b"x" * 60_000)}, data={"purpose": "batch"})
    assert r.status_code == 413  # --batch-max-file-mb 0.05
    assert alice.files.list().data == [] or all(f.bytes < 50_000 for f in alice.files.list().data)
    r = httpx.post(srv.url + "/v1/files", headers={"Authorization": f"Bearer {keys['alice']}"},
                   json={"purpose": "batch"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]


def test_batch_lines_are_priced_at_batch_rates(keyed):
    from decimal import Decimal

    from tokenmill.cost import load_cards, price

    srv, keys = keyed
    alice = openai.OpenAI(base_url=srv.url + "/v1", api_key=keys["alice"], max_retries=0)
    card = load_cards(None)["gpt-5.6-sol"]
    lines = [_chat_line(i, max_tokens=6) for i in range(3)]
    b = _wait(alice, _submit(alice, lines).id)
    total = Decimal(0)
    for r in _records(alice, b.output_file_id):
        u = r["response"]["body"]["usage"]
        cached = u["prompt_tokens_details"]["cached_tokens"]
        batch = price(card, input_tokens=u["prompt_tokens"], cached_tokens=cached,
                      output_tokens=u["completion_tokens"], batch=True)
        listed = price(card, input_tokens=u["prompt_tokens"], cached_tokens=cached,
                       output_tokens=u["completion_tokens"])
        assert u["cost"]["total_usd"] == pytest.approx(float(batch.total_usd))
        assert batch.total_usd == listed.total_usd / 2  # this card's batch rate: half price
        total += batch.total_usd
    cost = alice.batches.retrieve(b.id).model_extra["cost"]
    assert Decimal(cost["total_usd_exact"]) == total and cost["card"] == "gpt-5.6-sol"


def test_batch_survives_three_kill_9s(tmp_path):
    """Each kill lands while lines are running; after each restart the batch goes on,
    and at the end every line is answered exactly once."""
    data = tmp_path / "data"
    args = ("--data-dir", str(data), "--max-num-seqs", "16")
    srv = ServerProcess(*args).wait_ready()
    port = srv.port
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        lines = [_chat_line(i, max_tokens=24, ignore_eos=True) for i in range(120)]
        b = _submit(client, lines)
        kills = 0
        while kills < 3:
            before = client.batches.retrieve(b.id).request_counts.completed
            b = _wait(client, b.id, until=lambda x: x.status in FINAL or x.request_counts.completed >= before + 6)
            assert b.status == "in_progress", f"the batch ended before kill {kills + 1}: make it longer"
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait()
            kills += 1
            srv = ServerProcess(*args, port=port).wait_ready()
        b = _wait(client, b.id)
        assert b.status == "completed" and b.request_counts.completed == 120 and b.request_counts.failed == 0
        out = _records(client, b.output_file_id)
        ids = [r["custom_id"] for r in out]
        assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # none lost, none twice
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 24 for r in out)
        db = sqlite3.connect(data / "batch.db")
        attempts = [a for (a,) in db.execute("SELECT attempts FROM lines WHERE batch_id = ?", (b.id,))]
        assert max(attempts) >= 2  # some lines were cut by a kill and run again
    finally:
        srv.stop()


def test_cli_submit_wait_status_results(server, tmp_path):
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    lines = [_chat_line(i, max_tokens=5) for i in range(5)]
    src.write_bytes(_jsonl(lines))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tokenmill.cli", "batch", *args, "--url", server.url],
                              capture_output=True, text=True, timeout=300)

    r = cli("submit", str(src), "--wait", "--metadata", "job=nightly")
    assert r.returncode == 0, r.stderr
    batch_id = r.stdout.strip()
    assert batch_id.startswith("batch_") and "completed" in r.stderr and "5/5 done" in r.stderr
    r = cli("status", batch_id, "--json")
    assert json.loads(r.stdout)["metadata"] == {"job": "nightly"}
    out = tmp_path / "out.jsonl"
    r = cli("results", batch_id, "-o", str(out))
    assert r.returncode == 0 and sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == \
        sorted(x["custom_id"] for x in lines)
    assert batch_id in cli("list").stdout
    r = cli("cancel", batch_id)
    assert r.returncode == 1 and "409" in r.stderr and "completed" in r.stderr
    r = cli("status", "batch_nope")
    assert r.returncode == 1 and "404" in r.stderr
