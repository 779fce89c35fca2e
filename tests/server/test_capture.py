"""Capture and replay against real servers, snapshot pins and model aliases.

Server A (the exact mode, capturing every request) answers 50 mixed requests under
concurrency; a fresh server B with the same settings replays each capture identically;
server C, running another quantization, reports the first token that differs, refuses
A's pinned snapshot id, and captures only the keys flagged for it."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, add_key
from tokenmill.server.aliases import parse_alias
from tokenmill.server.capture import Captured, CaptureStore
from tokenmill.server.replay import ReplayReport, completion_body, replay

EXACT = ("--dtype", "float32", "--quantization", "none", "--max-num-seqs", "32")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SECRET = "my zebra's name is Quintessa"


# -- the store and the aliases, alone ----------------------------------------------------
def _captured(i: int, created: float, tokens: int = 100) -> Captured:
    return Captured(id=f"c{i}", tenant="t", created_at=created, operation="chat", snapshot="m@sha256:0",
                    params={"n": 1}, prompts=[list(range(tokens))], outputs=[[[1, 2, 3]]], finish=[["stop"]])


def test_the_store_keeps_captures_within_retention_and_size(tmp_path):
    path = str(tmp_path / "c.db")
    store = CaptureStore(path, retention_s=3600, max_bytes=10 ** 9)
    now = time.time()
    store.add(_captured(0, now - 7200))  # past retention
    store.add(_captured(1, now))
    assert store.prune(now) == 1 and store.ids() == ["c1"]
    assert store.get("c1") == _captured(1, now)
    assert store.get("c0") is None
    store.close()
    one = len(json.dumps(list(range(100)), separators=(",", ":")))
    small = CaptureStore(path, retention_s=3600, max_bytes=3 * one)
    for i in range(2, 8):
        small.add(_captured(i, now))
    assert small.size_bytes <= 3 * one
    assert small.ids() == ["c7", "c6"]  # newest kept, oldest gone first
    assert os.stat(path).st_mode & 0o077 == 0  # the owner's only
    small.close()
    reader = CaptureStore(path, retention_s=1, max_bytes=1, read_only=True)  # prunes nothing
    assert reader.ids() == ["c7", "c6"]
    with pytest.raises(sqlite3.OperationalError):
        reader.add(_captured(9, now))
    reader.close()


def test_aliases_parse_and_deprecate():
    a = parse_alias("old=m@2027-01-31", "m")
    assert (a.name, a.target, a.sunset) == ("old", "m", dt.date(2027, 1, 31))
    assert a.headers() == {"Deprecation": "@1801353600", "Sunset": "Sun, 31 Jan 2027 00:00:00 GMT"}
    p = parse_alias("prod=m@sha256:0123456789ab", "m")
    assert (p.target, p.sunset, p.headers()) == ("m@sha256:0123456789ab", None, {})
    assert parse_alias("prod=m@sha256:0123456789ab@2030-01-01", "m").target == "m@sha256:0123456789ab"
    for bad, why in (("old", "NAME=TARGET"), ("old=other", "serves"), ("m=m", "own name"),
                     ("old=m@2027-13-40", "not a date"), ("a b=m", "not a model name")):
        with pytest.raises(ValueError, match=why):
            parse_alias(bad, "m")


def test_a_replay_body_spells_out_every_resolved_parameter():
    c = Captured(id="x", tenant="t", created_at=0, operation="chat", snapshot="m@sha256:ab", prompts=[[1, 2]],
                 outputs=[[[3]]], finish=[["stop"]],
                 params={"n": 2, "greedy": False, "temperature": 1, "top_p": 0.9, "top_k": 5, "min_p": 0.0,
                         "presence_penalty": 0.0, "frequency_penalty": 0.5, "repetition_penalty": 1.0,
                         "seed": 7, "stop": ["\n"], "stop_token_ids": [9], "ignore_eos": False, "max_tokens": 4,
                         "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": False,
                         "logit_bias": {"3": 1.5}, "speculative": True,
                         "structured": {"kind": "json", "value": SCHEMA}, "thinking_token_budget": None})
    body = completion_body(c, "m")
    assert body["prompt"] == [1, 2] and body["return_token_ids"] and body["guided_json"] == SCHEMA
    assert body["temperature"] == 1.0 and isinstance(body["temperature"], float)
    assert (body["n"], body["seed"], body["top_k"], body["logit_bias"]) == (2, 7, 5, {"3": 1.5})


# -- live servers ------------------------------------------------------------------------
def _requests() -> list[tuple[str, dict]]:
    """50 mixed requests: greedy, seeded sampled, unseeded sampled (the capture draws its
    seed), constrained by a JSON schema, n > 1, several prompts, streamed."""
    out = []
    for k in range(50):
        msg = [{"role": "user", "content": f"Say something about the number {k}."}]
        kind = k % 6
        if kind == 0:
            out.append(("chat", {"messages": msg, "max_tokens": 12, "temperature": 0.0}))
        elif kind == 1:
            out.append(("chat", {"messages": msg, "max_tokens": 12, "temperature": 0.9, "seed": k}))
        elif kind == 2:
            out.append(("chat", {"messages": [{"role": "user", "content": f"A person aged {k}, as JSON."}],
                                 "max_tokens": 24, "temperature": 0.7, "seed": 1000 + k,
                                 "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "p", "schema": SCHEMA}}}))
        elif kind == 3:
            out.append(("chat", {"messages": msg, "max_tokens": 8, "temperature": 1.0, "n": 3}))
        elif kind == 4:
            out.append(("completions", {"prompt": [f"The number {k} is", f"Once, {k} birds"], "max_tokens": 10,
                                        "temperature": 0.8, "seed": k, "n": 2}))
        else:
            out.append(("chat", {"messages": msg, "max_tokens": 12, "temperature": 0.5, "seed": k, "stream": True}))
    return out


async def _send_all(url: str, reqs: list[tuple[str, dict]]) -> list[str]:
    sem = asyncio.Semaphore(16)

    async def one(client: httpx.AsyncClient, route: str, body: dict) -> str:
        async with sem:
            body = {"model": MODEL, **body}
            if body.get("stream"):
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    ident = None
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            ident = ident or chunk["id"]
                            assert chunk["system_fingerprint"].startswith(MODEL + "@sha256:")
                    return ident
            r = await client.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
            assert r.status_code == 200, r.text
            return r.json()["id"]

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(one(client, route, body) for route, body in reqs))


def _wait_for(store_path: str, ids: list[str], timeout: float = 30.0) -> dict[str, Captured]:
    deadline = time.monotonic() + timeout
    while True:
        store = CaptureStore(store_path, read_only=True)
        got = {i: store.get(i) for i in ids}
        store.close()
        if all(got.values()) or time.monotonic() > deadline:
            missing = [i for i, c in got.items() if c is None]
            assert not missing, f"not captured: {missing[:5]}"
            return got
        time.sleep(0.2)


def _replay_all(captures: list[Captured], url: str, api_key: str | None = None) -> list[ReplayReport]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda c: replay(c, url, api_key), captures))


@pytest.mark.slow
def test_capture_replays_identically_in_exact_mode_and_shows_a_changed_setting(tmp_path):
    db = str(tmp_path / "a" / "captures.db")
    a = ServerProcess(*EXACT, "--capture", "all", "--capture-db", db,
                      "--model-alias", f"old={MODEL}@2027-01-31").wait_ready()
    try:
        ids = asyncio.run(_send_all(a.url, _requests()))
        snap_a = httpx.get(a.url + "/v1/models").json()["data"][0]["snapshot"]
        # the pinned id serves; a deprecated alias answers with its headers
        r = httpx.post(a.url + "/v1/completions", json={"model": snap_a, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["system_fingerprint"] == snap_a
        r = httpx.post(a.url + "/v1/completions", json={"model": "old", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["Sunset"] == "Sun, 31 Jan 2027 00:00:00 GMT"
        assert r.headers["Deprecation"] == "@1801353600"
        captures = _wait_for(db, ids)
    finally:
        a.stop()
    assert len(captures) == 50
    for c in captures.values():
        assert c.snapshot == snap_a
        assert c.params["greedy"] or c.params["seed"] is not None  # unseeded sampling got a seed
        assert all(len(ids) > 0 for outs in c.outputs for ids in outs)
    assert {len(c.prompts) for c in captures.values()} == {1, 2}
    assert {c.params["n"] for c in captures.values()} == {1, 2, 3}

    b = ServerProcess(*EXACT, "--no-batch-api").wait_ready()  # fresh: nothing cached from A
    try:
        reports = _replay_all(list(captures.values()), b.url)
        cli = subprocess.run([sys.executable, "-m", "tokenmill.cli", "replay", ids[2], "--db", db,
                              "--base-url", b.url], capture_output=True, text=True, timeout=120)
    finally:
        b.stop()
    bad = [r.summary() for r in reports if not r.identical]
    assert not bad, bad
    assert all(r.replayed_snapshot == snap_a for r in reports)
    assert cli.returncode == 0 and "identical" in cli.stdout, cli.stdout + cli.stderr

    # another quantization: another snapshot; a pin on A's is refused; replays show the first differing token
    keys = str(tmp_path / "keys.db")
    flagged, plain = add_key(keys, "audited", "--capture"), add_key(keys, "other")
    db_c = str(tmp_path / "c" / "captures.db")
    c = ServerProcess("--dtype", "bfloat16", "--quantization", "int8", "--keys-db", keys, "--capture", "keys",
                      "--capture-db", db_c, "--model-alias", f"prod={snap_a}", "--no-batch-api",
                      "--log-level", "info", "--log-format", "json").wait_ready()  # a log line per request
    try:
        auth = {"Authorization": f"Bearer {plain}"}
        for model in (snap_a, "prod"):
            r = httpx.post(c.url + "/v1/completions", headers=auth,
                           json={"model": model, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 409 and r.json()["error"]["code"] == "snapshot_mismatch"
            snap_c = httpx.get(c.url + "/v1/models", headers=auth).json()["data"][0]["snapshot"]
            assert snap_a in r.json()["error"]["message"] and snap_c in r.json()["error"]["message"]
        reports = _replay_all(list(captures.values()), c.url, plain)
        differing = [r for r in reports if not r.identical]
        assert differing, "int8 weights answered all 50 requests exactly as float32 did"
        for r in differing:
            d = r.first_difference()
            j = d.first_difference
            assert d.captured[:j] == d.replayed[:j] and d.captured[j:j + 1] != d.replayed[j:j + 1]
            assert r.replayed_snapshot == snap_c != snap_a
        cli = subprocess.run([sys.executable, "-m", "tokenmill.cli", "replay", differing[0].capture_id, "--db", db,
                              "--base-url", c.url, "--api-key", plain], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1 and f"differs at token {differing[0].first_difference().first_difference}" \
            in cli.stdout, cli.stdout + cli.stderr
        # --capture keys: the flagged key's requests only
        got = []
        for key in (flagged, plain):
            r = httpx.post(c.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 3})
            assert r.status_code == 200
            got.append(r.json()["id"])
        captured = _wait_for(db_c, got[:1])
        assert captured[got[0]].tenant == "audited"
        store = CaptureStore(db_c, read_only=True)
        assert store.get(got[1]) is None and len(store.ids()) == 1  # neither the other key's nor the replays
        store.close()
        log = c.stop()
    finally:
        c.stop()
    assert got[0] in log and SECRET not in log  # the request is logged, its message text is not
