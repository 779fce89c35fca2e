"""`tokenmill cluster serve --model A --model B`: each model its own Ray Serve application
(one replica each here) behind one ingress, and a canary rollout across the two at that
ingress. Two tiny random Llamas made here (other weights each), checked against
transformers running the same weights."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.cluster.conftest import ray_processes
from tests.server.conftest import ServerProcess
from tests.server.test_multimodel import KV_GB, PROMPT, greedy, make_tiny
from tokenmill.cluster.models import app_name

N_USERS = 40


def test_application_names_come_from_the_model_names():
    assert app_name("tiny", set()) == "tokenmill-tiny"
    assert app_name("org/Model 7B", set()) == "tokenmill-org-Model-7B"
    assert app_name("a/b", {"tokenmill-a-b"}) == "tokenmill-a-b-2"  # a name that differs only in odd characters


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("ray")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("cluster-models")
    paths = {name: str(root / name) for name in ("tiny", "other")}
    return paths, {"tiny": make_tiny(paths["tiny"]), "other": make_tiny(paths["other"], seed=1)}


@pytest.fixture(scope="module")
def cluster(models):
    paths, _ = models
    srv = ServerProcess("--model", paths["tiny"], "--model", paths["other"], "--replicas", "1", "--num-threads", "1",
                        "--kv-cache-gb", str(KV_GB), "--dtype", "float32", "--quantization", "none",
                        "--rollout", "split=tiny:50,other:50", "--rollout-latency-margin", "100",
                        command=("cluster", "serve"), env={"RAY_DEDUP_LOGS": "0"}).wait_ready(timeout=300)
    yield srv
    out = srv.stop()
    assert srv.proc.returncode == 0, out[-3000:]
    deadline = time.monotonic() + 60
    while ray_processes() and time.monotonic() < deadline:  # its Ray cluster goes with it, both applications
        time.sleep(1)
    assert not ray_processes()


def complete(cluster, model: str, users: list[str | None]) -> list[httpx.Response]:
    """Four greedy tokens per user, eight at a time."""
    async def run() -> list[httpx.Response]:
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            async def one(user):
                async with sem:
                    return await client.post("/v1/completions", json={
                        "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                        "user": user})

            return await asyncio.gather(*(one(u) for u in users))

    return asyncio.run(run())


def text(model, tokenizer) -> str:
    return tokenizer.decode(greedy(model, PROMPT, 4), skip_special_tokens=False)


@pytest.mark.slow
def test_two_models_a_rollout_across_them_and_an_unknown_name(cluster, models):
    from tokenmill.model.metadata import load_model_info

    paths, refs = models
    tokenizer = load_model_info(paths["tiny"]).tokenizer
    want = {name: text(refs[name], tokenizer) for name in refs}
    assert want["tiny"] != want["other"]  # the answer tells the two apart
    for name in ("tiny", "other"):  # each by name, from its own replicas, as transformers runs its weights
        r = complete(cluster, name, [None])[0]
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name and r.json()["choices"][0]["text"] == want[name]
    listed = {m["id"]: m for m in httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]}
    assert {"tiny", "other", "split"} <= set(listed)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # (each replica reports every 0.5 s once its router knows it)
        replicas = httpx.get(cluster.url + "/v1/stats", timeout=10).json()["replicas"]
        if sorted((r["model"], r["requests"]) for r in replicas.values()) == [("other", 1), ("tiny", 1)]:
            break  # one replica each, and each served its own model's request
        time.sleep(0.5)
    else:
        pytest.fail(f"replicas: {replicas}")

    users = [f"user-{i}" for i in range(N_USERS)]
    placed = {}
    for user, r in zip(users, complete(cluster, "split", users)):
        assert r.status_code == 200, r.text
        body = r.json()
        arm = "canary" if body["model"] == "other" else "stable"
        assert r.headers["x-tokenmill-rollout"] == f"split; arm={arm}"
        assert body["choices"][0]["text"] == want[body["model"]]  # answered by the arm's own model
        placed[user] = body["model"]
    share = sum(m == "other" for m in placed.values()) / N_USERS
    assert 0.2 <= share <= 0.8, placed  # 50/50 (40 users: a split this uneven is 1 in 10,000)
    again = complete(cluster, "split", users[:12])
    assert [r.json()["model"] for r in again] == [placed[u] for u in users[:12]]  # sticky per user
    status = httpx.get(cluster.url + "/v1/rollouts/split", timeout=10).json()
    assert status["state"] == "running" and status["canary"]["errors"] == status["stable"]["errors"] == 0
    assert status["stable"]["requests"] + status["canary"]["requests"] == N_USERS + 12

    r = httpx.post(cluster.url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
