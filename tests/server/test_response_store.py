"""The stored-responses table on its own: per tenant, retention, and background
responses a stopped process left running."""

from __future__ import annotations

import time

import pytest

from tokenmill.server.dialects.response_store import ResponseStore


def obj(rid, status="completed", background=False):
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "background": background, "output": []}


def test_tenants_see_only_their_own(tmp_path):
    store = ResponseStore(tmp_path)
    store.put("alice", obj("r1"), [{"type": "message", "role": "user", "content": "hi"}])
    assert store.get("alice", "r1").conversation == [{"type": "message", "role": "user", "content": "hi"}]
    assert store.get("bob", "r1") is None and not store.delete("bob", "r1")
    store.put("bob", obj("r1", "failed"), [])  # bob cannot overwrite alice's row either
    assert store.get("alice", "r1").response["status"] == "completed" and store.get("bob", "r1") is None
    assert store.delete("alice", "r1") and store.get("alice", "r1") is None
    store.close()


def test_rows_expire_after_the_retention(tmp_path):
    store = ResponseStore(tmp_path, retention_s=0.2)
    store.put("alice", obj("old"), [])
    assert store.get("alice", "old") is not None
    time.sleep(0.3)
    assert store.get("alice", "old") is None and not store.delete("alice", "old")
    store.put("alice", obj("new"), [])  # writing purges what expired
    assert store._db.execute("SELECT id FROM responses").fetchall() == [("new",)]
    with pytest.raises(ValueError):
        ResponseStore(tmp_path, retention_s=0)
    store.close()


def test_live_background_rows_fail_when_reopened(tmp_path):
    store = ResponseStore(tmp_path)
    store.put("alice", obj("bg", "in_progress", background=True), [])
    store.put("alice", obj("q", "queued", background=True), [])
    store.close()
    again = ResponseStore(tmp_path)
    for rid in ("bg", "q"):
        r = again.get("alice", rid).response
        assert r["status"] == "failed" and r["error"]["message"]
    again.close()
