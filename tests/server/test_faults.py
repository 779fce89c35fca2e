"""Faults while the server works: an engine process that stops answering is caught
within its bound, its requests end with a clear error, it is replaced, and the first
request after it succeeds (a long step is not mistaken for a hang; one stopped while it
loads fails the start); a batch store locked by another process gets a clear 503 while
serving goes on, and no batch line is lost or run twice; a key store locked by another
process costs an unverified key a quick 503, a recently verified one nothing."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, add_key, metric
from tests.server.test_hardening import alive, engine_child

pytestmark = pytest.mark.slow

HANG_S = 2.0  # --engine-hang-timeout of the server below
SLACK_S = 1.5  # the watchdog's poll and heartbeat periods, and a busy machine


def _wait_ready(srv: ServerProcess, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(srv.url + "/ready", timeout=5).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the engine was not replaced")


def test_a_stopped_engine_is_caught_failed_fast_and_replaced():
    srv = ServerProcess("--engine-hang-timeout", str(HANG_S), "--max-num-batched-tokens", "2048").wait_ready()
    child = None
    try:
        # A long prefill (one step of 1,000 tokens, seconds on a busy machine) is work, not a hang: the heartbeat
        # comes from a thread of the child that does not step.
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": [[1000 + i % 5000 for i in range(1000)]], "max_tokens": 1})
        long_step = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert metric(srv, "tokenmill_engine_restarts") == 0
        print(f"a 1000-token prefill took {long_step:.2f}s with --engine-hang-timeout {HANG_S}")

        child = engine_child(srv)
        lines: list[str] = []
        whole: dict = {}
        stopped_at = 0.0

        def whole_request() -> None:  # sent to the stopped engine
            t = time.monotonic()
            resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 50})
            whole.update(status=resp.status_code, body=resp.json(), took=time.monotonic() - t)

        caller = threading.Thread(target=whole_request)
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}) as s:
            for line in s.iter_lines():
                if not line.startswith("data:"):
                    continue
                lines.append(line)
                if len(lines) == 5:
                    os.kill(child, signal.SIGSTOP)
                    stopped_at = time.monotonic()
                    caller.start()
        detected = time.monotonic() - stopped_at
        caller.join(60)
        print(f"hung engine detected and its stream ended {detected:.2f}s after SIGSTOP "
              f"(bound {HANG_S}s); the whole request got {whole.get('status')} after {whole.get('took', 0):.2f}s")
        assert HANG_S - 0.5 <= detected < HANG_S + SLACK_S, detected
        errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {") and '"error"' in x]
        assert errors and errors[0]["error"]["code"] == "engine_hung", lines[-3:]
        assert "no sign of life" in errors[0]["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        assert whole["status"] == 503 and whole["body"]["error"]["code"] == "engine_hung", whole
        assert whole["took"] < HANG_S + SLACK_S
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the stopped engine process was not killed"

        _wait_ready(srv)
        replaced = time.monotonic() - stopped_at
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        print(f"first good answer {time.monotonic() - stopped_at:.2f}s after SIGSTOP (ready after {replaced:.2f}s)")
        assert engine_child(srv) != child
        assert metric(srv, "tokenmill_engine_restarts") == 1
    finally:
        if child is not None and alive(child):
            os.kill(child, signal.SIGCONT)
        srv.stop()
    assert srv.proc.returncode == 0


def test_a_batch_store_locked_by_another_process(tmp_path):
    """Another process holds the batch database's write lock (as a backup or an operator's
    shell may): the Batch API answers 503 store_busy at once, chat goes on, lines finished
    meanwhile are stored once the lock is gone, and the batch ends with every line once."""
    import sqlite3

    import openai

    data = tmp_path / "data"
    srv = ServerProcess("--data-dir", str(data)).wait_ready()
    holder = None
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 24, "ignore_eos": True}}
                 for i in range(12)]
        f = client.files.create(file=("b.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).status != "in_progress" and time.monotonic() < deadline:
            time.sleep(0.1)

        chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        t0 = time.monotonic()
        assert httpx.post(srv.url + "/v1/chat/completions", timeout=30, json=chat_body).status_code == 200
        unlocked = time.monotonic() - t0
        holder = sqlite3.connect(data / "batch.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the write lock, held
        locked_at = time.monotonic()
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/batches", timeout=30, json={
            "input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h"})
        refused = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_busy", r.text
        assert r.headers["retry-after"] == "1"
        assert client.batches.retrieve(batch.id).status == "in_progress"  # reads go on (WAL)
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json=chat_body)
        chat = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert chat < unlocked + 5.0, (chat, unlocked)  # a loop stalled on the lock would show here
        time.sleep(max(0.0, locked_at + 4 - time.monotonic()))  # lines finish while it is locked
        holder.execute("ROLLBACK")
        holder.close()
        holder = None
        print(f"store locked 4s: the Batch API refused in {refused:.2f}s (503 store_busy), chat answered in "
              f"{chat:.2f}s (unlocked, beside the same batch: {unlocked:.2f}s)")

        deadline = time.monotonic() + 120
        while (b := client.batches.retrieve(batch.id)).status not in ("completed", "failed") \
                and time.monotonic() < deadline:
            time.sleep(0.3)
        assert b.status == "completed" and b.request_counts.completed == 12, b
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines() if x.strip()]
        assert sorted(r["custom_id"] for r in out) == sorted(x["custom_id"] for x in lines)  # none lost, none twice
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 24 for r in out)
        r = httpx.post(srv.url + "/v1/batches", timeout=30, json={
            "input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h"})
        assert r.status_code == 200, r.text
    finally:
        if holder is not None:
            holder.close()
        srv.stop()


def test_a_key_store_locked_by_another_process(tmp_path):
    """Another process holds the keys file's exclusive lock: a key verified within the
    cache's TTL goes on being served, an unverified one gets 503 store_busy in about a
    second (before: a 500 after sqlite3's 5 s busy wait, the event loop stalled with it),
    and /health, /ready and /metrics answer while the lookup waits."""
    import sqlite3

    db = tmp_path / "keys.db"
    seen, unseen = add_key(db, "alice"), add_key(db, "bob")
    srv = ServerProcess("--keys-db", str(db), "--keys-cache-ttl", "60").wait_ready()
    holder = None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def chat(key: str) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body,
                       timeout=30)
        return r, time.monotonic() - t0

    try:
        assert chat(seen)[0].status_code == 200
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        waiting: dict = {}
        thread = threading.Thread(target=lambda: waiting.update(answer=chat(unseen)))
        thread.start()
        time.sleep(0.3)  # the lookup now waits on the lock
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        health = time.monotonic() - t0
        thread.join(30)
        r, refused = waiting["answer"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_busy", r.text
        assert r.headers["retry-after"] == "1"
        assert refused < 3.0, refused
        assert health < 1.0, health  # a loop stalled on the lock would answer after the lookup
        r, served = chat(seen)
        assert r.status_code == 200, r.text
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
        assert "tokenmill_http_responses" in httpx.get(srv.url + "/metrics", timeout=10).text
        holder.execute("ROLLBACK")
        holder.close()
        holder = None
        time.sleep(1.2)  # (a lookup found it locked within the last second: refused without a read)
        assert chat(unseen)[0].status_code == 200
        print(f"keys locked: an unverified key refused in {refused:.2f}s (503 store_busy), /health in "
              f"{health:.2f}s meanwhile, a verified key served in {served:.2f}s")
    finally:
        if holder is not None:
            holder.close()
        out = srv.stop()
    assert "Traceback" not in out, out


def test_an_engine_stopped_while_it_loads_fails_the_start():
    """Stopped before it is ready, the engine would hold the start (or a restart) forever:
    past three times the hang timeout the server gives up with a clear line instead."""
    srv = ServerProcess("--engine-hang-timeout", "1")
    stopped = None
    try:
        deadline = time.monotonic() + 30
        while stopped is None and time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                pid = engine_child(srv)
            except AssertionError:  # not forked yet
                time.sleep(0.01)
                continue
            os.kill(pid, signal.SIGSTOP)
            stopped = pid, time.monotonic()
        assert stopped is not None, "no engine child was seen loading"
        code = srv.proc.wait(timeout=60)
        took = time.monotonic() - stopped[1]
        out = srv.proc.stdout.read()
        print(f"an engine stopped while loading failed the start {took:.1f}s later (bound 3s)")
        assert code != 0 and "no sign of life" in out and "while loading" in out, out[-2000:]
        assert took < 3 + 10  # the bound, the front's own start, a busy machine
        deadline = time.monotonic() + 5
        while alive(stopped[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(stopped[0])
    finally:
        if stopped is not None and alive(stopped[0]):
            os.kill(stopped[0], signal.SIGKILL)
        srv.stop()
