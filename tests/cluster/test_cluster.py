"""`tokenmill cluster serve` for real: a local Ray cluster, two engine replicas of the
embedded model (one thread each) behind the ingress, driven over HTTP and the openai SDK.

One cluster for the module (it takes a while to start); the tests run in file order and
the replica-killing one runs last.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.cluster.conftest import ray_processes
from tests.server.conftest import MODEL, ServerProcess, add_key
from tokenmill.kv.disk import SUFFIX

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

EXACT = ("--dtype", "float32", "--quantization", "none")
SYSTEM = ("You are a careful assistant for a bakery. Answer briefly, in plain words, and never invent "
          "prices or opening hours that the user did not give you. ") * 3


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    db = tmp_path_factory.mktemp("cluster-keys") / "keys.db"
    return {"db": db, "admin": add_key(db, "ops", "--admin"), "free": add_key(db, "free"),
            "limited": add_key(db, "limited", "--rpm", "4")}


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cluster-kv")


@pytest.fixture(scope="module")
def cluster(keys, kv_dir):
    srv = ServerProcess("--replicas", "2", "--num-threads", "1", "--keys-db", str(keys["db"]), *EXACT,
                        "--kv-disk-dir", str(kv_dir), "--kv-disk-gb", "0.5",
                        command=("cluster", "serve"), env={"RAY_DEDUP_LOGS": "0"}).wait_ready(timeout=300)
    yield srv
    out = srv.stop()
    # a SIGTERM drains and exits 0: a supervisor must not record a crash for a clean stop
    assert srv.proc.returncode == 0, out[-3000:]
    assert "SIGTERM received at time" not in out  # Ray's failure-signal handler stayed out of it
    deadline = time.monotonic() + 60
    while ray_processes() and time.monotonic() < deadline:  # its Ray cluster goes with it
        time.sleep(1)
    assert not ray_processes()


def stats(cluster, keys) -> dict:
    r = httpx.get(cluster.url + "/v1/stats", headers={"Authorization": f"Bearer {keys['admin']}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def replica_requests(cluster, keys) -> dict[str, int]:
    time.sleep(1.2)  # the replicas report every 0.5 s
    return {rid: r["requests"] for rid, r in stats(cluster, keys)["replicas"].items()}


def chat(cluster, key: str, content: str, max_tokens: int = 16, system: str | None = None,
         **extra) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return httpx.post(cluster.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra},
                      timeout=120)


def test_openai_sdk_through_the_ingress(cluster, keys):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=keys["free"], max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to five."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 12
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert {m.id for m in client.models.list().data} == {MODEL}


def test_cancel_reaches_the_replica(cluster, keys):
    with httpx.stream("POST", cluster.url + "/v1/chat/completions",
                      headers={"Authorization": f"Bearer {keys['free']}"}, timeout=120,
                      json={"model": MODEL, "stream": True, "max_tokens": 2000, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "Write a very long story."}]}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 10:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.6)
        replicas = stats(cluster, keys)["replicas"]
        if all(r["stats"]["num_running"] == 0 and r["stats"]["kv_blocks_used"] == 0 for r in replicas.values()):
            break
    else:
        pytest.fail(f"the aborted request still runs on its replica: {replicas}")


def test_greedy_output_equals_a_single_server(cluster, keys):
    prompts = ["What is the capital of France?", "List three fruits.", "Say hello in Spanish."]
    got = [chat(cluster, keys["free"], p, 24).json()["choices"][0]["message"]["content"] for p in prompts]
    single = ServerProcess("--num-threads", "1", "--no-batch-api", *EXACT).wait_ready()
    try:
        want = [httpx.post(single.url + "/v1/chat/completions", timeout=120,
                           json={"model": MODEL, "max_tokens": 24, "temperature": 0,
                                 "messages": [{"role": "user", "content": p}]}).json()["choices"][0]["message"]["content"]
                for p in prompts]
    finally:
        single.stop()
    assert got == want


def test_prefix_affinity_keeps_a_system_prompt_on_one_replica(cluster, keys):
    before = replica_requests(cluster, keys)
    cached = []
    for q in ("Do you sell bread?", "Are you open on Sunday?", "What cakes do you have?", "Can I order online?"):
        r = chat(cluster, keys["free"], q, 4, system=SYSTEM)
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = replica_requests(cluster, keys)
    grew = {rid: after[rid] - before.get(rid, 0) for rid in after}
    assert sorted(grew.values()) == [0, 4], grew  # all four on one replica
    assert all(c >= 64 for c in cached[1:]), cached  # and its prefix cache served the system prompt
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    assert 'tokenmill_router_decisions_total{decision="hit"}' in text
    assert "tokenmill_replica_requests_total" in text and "tokenmill_replicas 2.0" in text


def test_a_tenants_rpm_holds_across_replicas(cluster, keys):
    before = replica_requests(cluster, keys)
    codes, headers = [], None
    for i in range(7):  # each its own cache salt, so no prefix is known: the router spreads them
        r = chat(cluster, keys["limited"], f"Topic {i}: say one word about the number {i * 7919}.", 2,
                 cache_salt=f"s{i}")
        codes.append(r.status_code)
        if r.status_code == 429:
            headers = r.headers
    after = replica_requests(cluster, keys)
    assert codes.count(200) == 3 and codes.count(429) == 4, codes  # the burst of a 4/minute limit, once
    assert headers["x-ratelimit-limit-requests"] == "4" and headers["x-ratelimit-remaining-requests"] == "0"
    assert int(headers["retry-after"]) >= 1
    assert all(after[rid] > before.get(rid, 0) for rid in after), (before, after)  # both replicas served it


def test_each_replica_keeps_its_own_kv_disk_folder(cluster, keys, kv_dir):
    """--kv-disk-dir under cluster serve: each replica claims a folder of its own under it
    (one server per folder, as the disk tier's lock demands) and writes its blocks there."""
    for i in range(4):
        assert chat(cluster, keys["free"], f"Tell me about bread number {i}. " * 8).status_code == 200
    folders = sorted(p.name for p in kv_dir.iterdir() if p.is_dir())
    assert folders == ["replica-0", "replica-1"]
    deadline = time.monotonic() + 30  # (written in the background)
    while time.monotonic() < deadline and not list(kv_dir.rglob(f"*{SUFFIX}")):
        time.sleep(0.5)
    assert list(kv_dir.rglob(f"*{SUFFIX}"))


def test_a_killed_replica_fails_its_requests_and_the_service_goes_on(cluster, keys):
    reps = stats(cluster, keys)["replicas"]
    assert len(reps) == 2
    with httpx.stream("POST", cluster.url + "/v1/chat/completions",
                      headers={"Authorization": f"Bearer {keys['free']}"}, timeout=60,
                      json={"model": MODEL, "stream": True, "max_tokens": 3000, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "Tell me everything about bread."}]}) as r:
        lines = r.iter_lines()
        next(lines)
        time.sleep(1.2)
        holder = [rid for rid, rep in stats(cluster, keys)["replicas"].items() if rep["stats"]["num_running"]]
        assert len(holder) == 1
        victim_id = holder[0]
        os.kill(reps[victim_id]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        rest = "\n".join(lines)  # ends (with an error event), never hangs: httpx's timeout would fail it
    print(f"the killed replica's stream ended {time.monotonic() - t0:.2f}s after SIGKILL: {rest[-400:]}")
    assert '"code": "engine_unavailable"' in rest and "the replica serving this request failed" in rest, rest[-500:]
    assert rest.rstrip().endswith("data: [DONE]"), rest[-200:]
    survivor = next(rid for rid in reps if rid != victim_id)
    before = replica_requests(cluster, keys)
    for i in range(4):  # the survivor answers at once: the router sends nothing to the dead replica
        assert chat(cluster, keys["free"], f"Quick question {i}: name an animal.", 4).status_code == 200
    after = replica_requests(cluster, keys)
    assert after[survivor] - before[survivor] == 4, (before, after)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # and Ray Serve starts a replacement
        time.sleep(2)
        reps = stats(cluster, keys)["replicas"]
        if len(reps) == 2 and victim_id not in reps:
            print(f"a replacement replica reported {time.monotonic() - t0:.1f}s after SIGKILL")
            break
    else:
        pytest.fail(f"no replacement replica: {reps}")
    assert httpx.get(cluster.url + "/ready", timeout=10).status_code == 200
    newcomer = next(rid for rid in reps if rid != survivor)
    for i in range(8):  # the replacement takes its share (each its own cache salt: no prefix draws it elsewhere)
        assert chat(cluster, keys["free"], f"Another question {i}: name a city.", 4,
                    cache_salt=f"after-{i}").status_code == 200
        if replica_requests(cluster, keys).get(newcomer):
            break
    else:
        pytest.fail(f"the replacement replica {newcomer} got none of 8 requests: {replica_requests(cluster, keys)}")
