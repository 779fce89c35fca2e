"""A full disk under the data directory and the KV disk tier: a real one, a small tmpfs
mounted for the test and filled to the last byte (ENOSPC from the kernel, as a full
volume gives it; skipped where this process may not mount, with the reason). While it is
full, every write the server owns fails cleanly: an upload, a new batch and a stored
response get a 507 naming the full disk, a chat answer still comes (its capture is
skipped and counted, and the KV tier's block writes are skipped and counted), and
everything read from the disk still reads. Once room is made, the first request of each
kind succeeds, and what was stored before the fault (the batch, its results, the stored
response, the captures) is whole: the same bytes, and SQLite's integrity check passes."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, metric

pytestmark = pytest.mark.slow

DATA_MB = 8  # the data directory's volume: the batch and capture databases, files, results
KV_MB = 4  # the KV tier's volume: a few of SmolLM2's 16-token blocks (~0.7 MB each in float32)
LINE = ('{"custom_id": "c%d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "%s", '
        '"messages": [{"role": "user", "content": "Say %d"}], "max_tokens": 2}}\n')
# ~300 tokens: long enough for the KV tier to write whole blocks
LONG = " ".join(f"Clause {i}: the tenant keeps the keys and returns them on day {i}." for i in range(24))


def _mount(path) -> None:
    os.makedirs(path, exist_ok=True)
    size = {"data": DATA_MB, "kv": KV_MB}[os.path.basename(path)]
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a real full disk needs a tmpfs mount, which this process may not do: {r.stderr.strip()}")


@pytest.fixture()
def volumes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs mount, which needs root (CAP_SYS_ADMIN)")
    data, kv = tmp_path / "data", tmp_path / "kv"
    mounted = []
    try:
        for v in (data, kv):
            _mount(v)
            mounted.append(v)
        yield data, kv
    finally:
        for v in mounted:
            subprocess.run(["umount", "-l", str(v)], capture_output=True)


def fill(volume) -> str:
    """Write a file until the volume refuses another byte; its path (delete it to make room)."""
    path = os.path.join(volume, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            while True:
                f.write(b"\0")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return path


def chat(srv, content: str = "Say hi", **extra) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra})


def upload(srv, n: int) -> httpx.Response:
    text = "".join(LINE % (i, MODEL, i) for i in range(n))
    return httpx.post(srv.url + "/v1/files", data={"purpose": "batch"}, timeout=60,
                      files={"file": ("in.jsonl", text, "application/jsonl")})


def run_batch(srv, file_id: str) -> dict:
    r = httpx.post(srv.url + "/v1/batches", timeout=60, json={"input_file_id": file_id,
                                                              "endpoint": "/v1/chat/completions"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        b = httpx.get(f"{srv.url}/v1/batches/{r.json()['id']}", timeout=30).json()
        if b["status"] in ("completed", "failed", "expired", "cancelled"):
            return b
        time.sleep(0.3)
    raise AssertionError(f"the batch did not end: {b}")


def integrity(db) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute("PRAGMA integrity_check").fetchone()[0]


def test_a_full_disk_fails_writes_cleanly_and_keeps_what_is_stored(volumes):
    data, kv = volumes
    srv = ServerProcess("--data-dir", str(data), "--capture", "all", "--kv-disk-dir", str(kv), "--kv-disk-gb", "1",
                        "--dtype", "float32", "--quantization", "none", "--max-model-len", "1024").wait_ready()
    try:
        # before: a finished batch with its results, a stored response, captures
        f = upload(srv, 3)
        assert f.status_code == 200, f.text
        before = run_batch(srv, f.json()["id"])
        assert before["status"] == "completed", before
        results = httpx.get(f"{srv.url}/v1/files/{before['output_file_id']}/content", timeout=30).content
        resp = httpx.post(srv.url + "/v1/responses", timeout=120,
                          json={"model": MODEL, "input": "Say hi", "max_output_tokens": 2})
        assert resp.status_code == 200, resp.text
        stored = httpx.get(f"{srv.url}/v1/responses/{resp.json()['id']}", timeout=30).json()
        assert chat(srv).status_code == 200

        kv_faults = metric(srv, "tokenmill_kv_disk_faults_total")
        caught = httpx.post(srv.url + "/v1/batches", timeout=60, json={  # its lines end while the disk is full
            "input_file_id": upload(srv, 4).json()["id"], "endpoint": "/v1/chat/completions"}).json()["id"]

        fillers = [fill(data), fill(kv)]
        # while full: each write fails with a clear error, serving goes on, reads go on
        refused = [upload(srv, 1),
                   httpx.post(srv.url + "/v1/batches", timeout=60, json={"input_file_id": f.json()["id"],
                                                                         "endpoint": "/v1/chat/completions"}),
                   httpx.post(srv.url + "/v1/responses", timeout=120,
                              json={"model": MODEL, "input": "Say hi", "max_output_tokens": 2})]
        for r in refused:
            assert r.status_code == 507, r.text
            err = r.json()["error"]
            assert err["code"] == "insufficient_storage" and "disk" in err["message"] and "full" in err["message"]
        r = chat(srv, LONG)  # captured and written to the KV tier, were there room
        assert r.status_code == 200, r.text
        assert metric(srv, "tokenmill_kv_disk_faults_total") > kv_faults
        assert httpx.get(f"{srv.url}/v1/files/{before['output_file_id']}/content", timeout=30).content == results
        assert httpx.get(f"{srv.url}/v1/responses/{resp.json()['id']}", timeout=30).json() == stored
        assert httpx.get(f"{srv.url}/v1/batches/{before['id']}", timeout=30).json() == before
        time.sleep(2)  # the caught batch's lines run, and their results wait for room

        for p in fillers:
            os.unlink(p)
        # the first request of each kind after the fault succeeds
        assert chat(srv, LONG).status_code == 200
        g = upload(srv, 2)
        assert g.status_code == 200, g.text
        after = run_batch(srv, g.json()["id"])
        assert after["status"] == "completed", after
        assert httpx.get(f"{srv.url}/v1/files/{before['output_file_id']}/content", timeout=30).content == results
        assert httpx.get(f"{srv.url}/v1/responses/{resp.json()['id']}", timeout=30).json() == stored
        assert httpx.post(srv.url + "/v1/responses", timeout=120,
                          json={"model": MODEL, "input": "Say hi", "max_output_tokens": 2}).status_code == 200
        # the batch caught by the fault: every line's result exactly once
        deadline = time.monotonic() + 120
        while (b := httpx.get(f"{srv.url}/v1/batches/{caught}", timeout=30).json())["status"] != "completed":
            assert b["status"] in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, b
            time.sleep(0.3)
        out = httpx.get(f"{srv.url}/v1/files/{b['output_file_id']}/content", timeout=30).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in out) == [f"c{i}" for i in range(4)]
        assert b["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    finally:
        log = srv.stop()
    assert "could not store capture" in log  # a capture is a record: skipped, logged, the answer still sent
    assert "Traceback" not in log, log[-3000:]
    for db in (data / "batch.db", data / "captures.db"):
        assert integrity(db) == "ok", db
