"""Canary rollouts and shadows (tokenmill/server/traffic.py, rollouts.py, shadow.py) on a
real server with five tiny models made here: `tiny`, its byte-identical `twin`, `other`
(other random weights), `broken` (its weights cut short: it fails to load) and `short`
(tiny's weights, whose generation_config.json stops every answer after 2 tokens). The
split by weight, stickiness, the operator's routes, the automatic rollback of a broken
canary (no client request failing) and of a canary whose answers fail their requests'
checks, and shadows that compare without touching the answers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.server.conftest import ServerProcess
from tests.server.test_multimodel import KV_GB, PROMPT, greedy, make_tiny
from tokenmill.server.rollouts import (Observed, Rollout, RolloutMetrics, RolloutSpec, Thresholds, bucket,
                                       parse_rollout)
from tokenmill.server.shadow import parse_shadow

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

N_SPLIT = 200


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-models")
    paths = {name: str(root / name) for name in ("tiny", "twin", "other", "broken", "short")}
    ref = make_tiny(paths["tiny"])
    shutil.copytree(paths["tiny"], paths["twin"])
    make_tiny(paths["other"], seed=1)
    shutil.copytree(paths["tiny"], paths["broken"])
    weights = os.path.join(paths["broken"], "model.safetensors")
    with open(weights, "r+b") as f:  # its header intact, its tensors cut short: fails at load, not before
        f.truncate(os.path.getsize(weights) // 2)
    shutil.copytree(paths["tiny"], paths["short"])
    config = os.path.join(paths["short"], "generation_config.json")
    with open(config) as f:
        generation = json.load(f)
    with open(config, "w") as f:  # its answers end after 2 tokens when a request sets no limit
        json.dump({**generation, "max_new_tokens": 2}, f)
    return paths, ref


@pytest.fixture(scope="module")
def server(models):
    paths, _ = models
    # the latency rule is held off here (noise between two tiny models on a busy machine);
    # it is tested on the Rollout itself below
    srv = ServerProcess(*(a for m in paths.values() for a in ("--model", m)), "--kv-cache-gb", str(KV_GB),
                        "--dtype", "float32", "--max-num-seqs", "16",
                        "--rollout", "split=tiny:70,twin:30", "--rollout", "bad=tiny:50,broken:50",
                        "--rollout", "worse=tiny:50,other:50", "--rollout-min-agreement", "0.5",
                        "--rollout", "cut=tiny:50,short:50", "--rollout", "checked=tiny:50,twin:50",
                        "--rollout-success-margin", "0.2",
                        "--shadow", "tiny=twin:1", "--shadow", "other=tiny", "--rollout-min-requests", "5",
                        "--rollout-latency-margin", "100").wait_ready()
    yield srv
    srv.stop()


def status(server, name: str | None = None) -> dict:
    r = httpx.get(server.url + "/v1/rollouts" + (f"/{name}" if name else ""), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def metric(server, line_start: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ask(server, model: str, users, concurrency: int = 8) -> list:
    """One greedy token per user, `concurrency` at a time: the raw responses (headers too)."""
    async def run() -> list:
        sem = asyncio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            async def one(user):
                async with sem:
                    return await client.completions.with_raw_response.create(
                        model=model, prompt=PROMPT, max_tokens=1, temperature=0, user=user,
                        extra_body={"ignore_eos": True})

            return await asyncio.wait_for(asyncio.gather(*(one(u) for u in users)), 300)

    return asyncio.run(run())


def test_weights_split_sticky_per_user_and_reported(server):
    users = [f"user-{i}" for i in range(N_SPLIT)]
    raws = ask(server, "split", users)
    placed = {}
    for user, raw in zip(users, raws):
        r = raw.parse()
        assert r.model in ("tiny", "twin") and raw.headers["x-tokenmill-model"] == r.model
        arm = "canary" if r.model == "twin" else "stable"
        assert raw.headers["x-tokenmill-rollout"] == f"split; arm={arm}"
        assert r.system_fingerprint.startswith(f"{r.model}@sha256:")
        placed[user] = r.model
    share = sum(m == "twin" for m in placed.values()) / N_SPLIT
    assert 0.22 <= share <= 0.38, share  # weight 30 of 100
    again = ask(server, "split", users[:30])
    assert [raw.parse().model for raw in again] == [placed[u] for u in users[:30]]  # sticky
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="split", user=users[0], max_tokens=1,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == placed[users[0]]  # the conversation stays on its side, whatever the route
    msg = httpx.post(server.url + "/v1/messages", json={"model": "split", "max_tokens": 1, "metadata": {
        "user_id": users[0]}, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)  # Anthropic's dialect
    assert msg.status_code == 200 and msg.headers["x-tokenmill-model"] == placed[users[0]]
    st = status(server, "split")
    canary = sum(m == "twin" for m in placed.values()) + sum(placed[u] == "twin" for u in users[:30] + users[:1] * 2)
    assert st["state"] == "running" and st["canary"]["requests"] == canary and st["canary"]["errors"] == 0
    assert st["stable"]["requests"] + canary == N_SPLIT + 32
    assert metric(server, 'tokenmill_rollout_requests_total{arm="canary",model="twin",outcome="ok",'
                          'rollout="split"}') == canary
    stable = N_SPLIT + 32 - canary
    assert metric(server, 'tokenmill_rollout_latency_seconds_count{arm="stable",rollout="split"}') == stable
    deadline = time.monotonic() + 30
    while status(server, "split")["agreement"]["checked"] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)  # the twin's greedy answers, checked against tiny's after they were sent
    agreement = status(server, "split")["agreement"]
    assert agreement["checked"] >= 3 and agreement["matches"] == agreement["checked"]
    rows = {m["id"]: m for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert rows["split"]["rollout"] == {"stable": "tiny", "canary": "twin", "weights": {"tiny": 70, "twin": 30},
                                        "state": "running"}


def test_operator_sets_weights_promotes_and_bad_input_is_refused(server):
    url = server.url + "/v1/rollouts/split"
    try:
        r = httpx.post(url, json={"weights": {"tiny": 0, "twin": 100}}, timeout=10)
        assert r.status_code == 200 and r.json()["weights"] == {"tiny": 0, "twin": 100}
        assert {raw.parse().model for raw in ask(server, "split", [f"w{i}" for i in range(8)])} == {
            "twin"}
        r = httpx.post(url, json={"action": "promote"}, timeout=10)
        assert r.status_code == 200 and status(server, "split")["state"] == "promoted"
        for bad in ({"weights": {"tiny": 1}}, {"weights": {"tiny": -1, "twin": 2}}, {"weights": {"tiny": 0, "twin": 0}},
                    {"weights": {"tiny": True, "twin": 1}}, {"action": "explode"}, {}, [1],
                    {"weights": {"tiny": 1, "twin": 1}, "action": "promote"}):
            assert httpx.post(url, json=bad, timeout=10).status_code == 400, bad
        assert httpx.post(url, content=b"{not json", timeout=10).status_code == 400
        assert httpx.post(server.url + "/v1/rollouts/nope", json={"action": "promote"}, timeout=10).status_code == 404
        assert httpx.get(server.url + "/v1/rollouts/nope", timeout=10).status_code == 404
        cli = [sys.executable, "-m", "tokenmill.cli", "rollout"]
        out = subprocess.run([*cli, "abort", "split", "--base-url", server.url], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "rollback" in out.stdout, out.stderr
        out = subprocess.run([*cli, "status", "--base-url", server.url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "split  rolled_back  stable tiny w100" in out.stdout, out.stdout + out.stderr
        assert "shadow tiny -> twin" in out.stdout
        decisions = status(server, "split")["decisions"]
        assert [d["action"] for d in decisions[-3:]] == ["set_weights", "promote", "rollback"]
        assert all(d["by"] == "operator" for d in decisions[-3:])
    finally:
        httpx.post(url, json={"weights": {"tiny": 70, "twin": 30}}, timeout=10)


def test_broken_canary_is_rolled_back_and_no_client_request_fails(server):
    raws = ask(server, "bad", [f"b{i}" for i in range(40)], concurrency=8)
    assert all(raw.parse().model == "tiny" for raw in raws)  # every one answered, by the stable arm
    failed_over = [raw for raw in raws if raw.headers["x-tokenmill-rollout"] == "bad; arm=stable; failover"]
    assert failed_over
    st = status(server, "bad")
    assert st["state"] == "rolled_back" and st["canary"]["weight"] == 0 and st["stable"]["weight"] == 50
    decision = st["decisions"][-1]
    assert decision["action"] == "rollback" and decision["by"] == "auto"
    evidence = decision["evidence"]
    assert evidence["rule"] == "error_rate" and evidence["canary"]["window_error_rate"] == 1.0
    assert evidence["stable"]["window_error_rate"] == 0.0 and evidence["canary"]["window"] >= 5
    assert metric(server, 'tokenmill_rollout_rollbacks_total{rollout="bad"}') == 1.0
    assert metric(server, 'tokenmill_rollout_failovers_total{rollout="bad"}') == st["canary"]["errors"] >= 5
    # rolled back: nobody is sent to the canary any more
    later = ask(server, "bad", [f"b{i}" for i in range(40)])
    assert {raw.headers["x-tokenmill-rollout"] for raw in later} == {"bad; arm=stable"}
    assert status(server, "bad")["canary"]["errors"] == st["canary"]["errors"]


def test_a_canary_that_answers_otherwise_is_rolled_back_on_agreement(server):
    """`other` (other random weights) as the canary of `tiny`: its greedy answers are checked
    against tiny's on the same requests, and the rollout falls below 50% agreement (the
    twin canary of `split` agreed every time: the test above)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i in range(80):
        r = client.completions.create(model="worse", prompt=PROMPT, max_tokens=4, temperature=0, user=f"w{i}",
                                      extra_body={"ignore_eos": True})
        assert r.model in ("tiny", "other")
        if status(server, "worse")["state"] != "running":
            break
        time.sleep(0.05)  # a check runs after its answer: give it a moment
    st = status(server, "worse")
    assert st["state"] == "rolled_back" and st["canary"]["weight"] == 0, st
    evidence = st["decisions"][-1]["evidence"]
    assert evidence["rule"] == "agreement" and evidence["agreement"]["rate"] < 0.5
    assert evidence["agreement"]["checked"] >= 5 and evidence["canary"]["window_error_rate"] == 0.0
    assert metric(server, 'tokenmill_rollout_agreement_total{result="differ",rollout="worse"}') >= 3


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def checked_request(client, model: str, i: int):
    """A sampled chat request (no agreement check: that is for greedy answers) whose answer
    carries a check: a json_schema. No max_tokens: each model's own default limit applies.
    (Forced tool calls are checked the same way, tests/server/test_answer_check.py; a random
    model's calls here would not finish: the call grammar lets it write whitespace at will.)"""
    return client.chat.completions.create(
        model=model, user=f"{model}-{i}", temperature=1.0, seed=i, messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})


def test_a_canary_whose_answers_fail_their_checks_is_rolled_back_on_success(server):
    """`short` (answers cut after 2 tokens) as the canary of `tiny`: every JSON answer it writes
    is unfinished, so its checked answers fail while tiny's pass; the
    rollout falls back on the success rule with no request failing."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i in range(80):
        r = checked_request(client, "cut", i)
        if r.model == "tiny":  # the stable arm's answers are whole and valid
            assert json.loads(r.choices[0].message.content) in ({"ok": True}, {"ok": False})
        else:
            assert r.model == "short" and r.choices[0].finish_reason == "length"
        if status(server, "cut")["state"] != "running":
            break
    st = status(server, "cut")
    assert st["state"] == "rolled_back" and st["canary"]["weight"] == 0, st
    evidence = st["decisions"][-1]["evidence"]
    assert evidence["rule"] == "success_rate" and evidence["success_margin"] == 0.2
    c, s = evidence["canary"], evidence["stable"]
    assert c["window_success_rate"] == 0.0 and s["window_success_rate"] == 1.0
    assert min(c["window_checked"], s["window_checked"]) >= 5 and c["window_error_rate"] == 0.0
    assert st["canary"]["checked"] == c["window_checked"] and st["canary"]["passed"] == 0
    assert metric(server, 'tokenmill_rollout_checks_total{arm="canary",result="fail",rollout="cut"}') == c["checked"]
    assert metric(server, 'tokenmill_rollout_checks_total{arm="canary",result="pass",rollout="cut"}') == 0


def test_a_canary_whose_answers_pass_their_checks_keeps_running(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i in range(60):
        checked_request(client, "checked", i)
        st = status(server, "checked")
        if min(st["stable"]["window_checked"], st["canary"]["window_checked"]) >= 6:
            break
    assert st["state"] == "running" and not st["decisions"], st
    for arm in ("stable", "canary"):
        assert st[arm]["window_success_rate"] == 1.0 and st[arm]["passed"] == st[arm]["checked"] >= 6
    unchecked = client.chat.completions.create(model="checked", user="checked-0", max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
    assert unchecked.model in ("tiny", "twin")  # a request with no check of its own is not counted as one
    after = status(server, "checked")
    assert sum(after[a]["checked"] for a in ("stable", "canary")) == sum(st[a]["checked"] for a in ("stable", "canary"))
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "rollout", "status", "checked", "--base-url",
                          server.url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"checked {st['canary']['checked']}/{st['canary']['checked']} passed" in out.stdout


def _shadow(server, name: str) -> dict:
    return next(s for s in status(server)["shadows"] if s["id"] == name)


def _wait_shadow(server, name: str, done: int, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = _shadow(server, name)
        if s["ok"] + s["error"] + s["dropped"] + s["skipped"] >= done:
            return s
        time.sleep(0.1)
    raise AssertionError(f"the shadow of {name} never finished {done}: {_shadow(server, name)}")


def test_shadow_compares_without_touching_answers_or_bills(server, models):
    _, ref = models
    from tokenmill.model.metadata import load_model_info

    want = load_model_info(models[0]["tiny"]).tokenizer.decode(greedy(ref, PROMPT, 8), skip_special_tokens=False)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def anonymous_requests() -> int:
        stats = httpx.get(server.url + "/v1/stats", timeout=10).json()
        return next(t["requests"] for t in stats["tenants"] if t["tenant"] == "anonymous")

    before = anonymous_requests()
    for i in range(4):  # greedy: the twin's tokens must match exactly; half of them streamed
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        else:
            r = client.completions.with_raw_response.create(**kw)
            assert "x-tokenmill-rollout" not in r.headers
            r = r.parse()
            assert r.model == "tiny" and r.usage.completion_tokens == 8
            text = r.choices[0].text
        assert text == want  # the client's answer is the primary's, as transformers computes it
        _wait_shadow(server, "tiny", i + 1)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3)  # sampled
    tiny = _wait_shadow(server, "tiny", 5)
    assert tiny["ok"] == 5 and tiny["compared"] == 4 and tiny["matches"] == 4 and tiny["match_rate"] == 1.0
    assert tiny["recent"][-1]["greedy"] is False and tiny["latency"]["shadow_p99_s"] > 0
    for i in range(2):  # another model's shadow: its tokens differ, and where is said
        client.completions.create(model="other", prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
        _wait_shadow(server, "other", i + 1)
    other = _shadow(server, "other")
    assert other["ok"] == 2 and other["compared"] == 2 and other["matches"] == 0
    assert isinstance(other["recent"][-1]["first_difference"]["token"], int)
    assert metric(server, 'tokenmill_shadow_compared_total{result="match",shadow="tiny"}') == 4
    assert metric(server, 'tokenmill_shadow_compared_total{result="differ",shadow="other"}') == 2
    assert anonymous_requests() - before == 7  # the client's own: no shadow is the tenant's


@pytest.mark.slow
def test_keys_stickiness_per_key_allowed_names_and_admin_routes(models, tmp_path):
    from tokenmill.server.keys import KeyStore, TenantLimits

    paths, _ = models
    store = KeyStore(tmp_path / "keys.db")
    keys = [store.add_key(f"t{i}") for i in range(4)]
    admin = store.add_key("ops", admin=True)
    scoped = store.add_key("scoped", TenantLimits(allowed_models=("r",)))
    store.close()
    srv = ServerProcess("--model", paths["tiny"], "--model", paths["twin"], "--kv-cache-gb", str(KV_GB),
                        "--dtype", "float32", "--keys-db", str(tmp_path / "keys.db"),
                        "--rollout", "r=tiny:50,twin:50").wait_ready()
    try:
        def ask_as(key: str, model: str = "r", **kw):
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)
            return c.completions.create(model=model, prompt=PROMPT, max_tokens=1, **kw)

        for key in keys:  # without `user`, a key's requests stay on one side
            assert len({ask_as(key).model for _ in range(3)}) == 1
        assert {ask_as(keys[0], user=f"u{i}").model for i in range(12)} == {"tiny", "twin"}  # `user` wins
        assert ask_as(scoped).model in ("tiny", "twin")  # a key limited to the rollout's name may use it
        with pytest.raises(openai.NotFoundError):
            ask_as(scoped, "tiny")
        url = srv.url + "/v1/rollouts"
        assert httpx.get(url, headers={"authorization": f"Bearer {keys[0]}"}, timeout=10).status_code == 403
        r = httpx.post(url + "/r", json={"action": "rollback"}, headers={"authorization": f"Bearer {keys[0]}"},
                       timeout=10)
        assert r.status_code == 403
        r = httpx.post(url, json={"rollout": "s=tiny:1,twin:1"}, headers={"authorization": f"Bearer {keys[0]}"},
                       timeout=10)
        assert r.status_code == 403 and "s" not in {m["id"] for m in ask_models(srv, admin)}
        r = httpx.post(url, json={"rollout": "s=tiny:1,twin:1"}, headers={"authorization": f"Bearer {admin}"},
                       timeout=10)
        assert r.status_code == 200 and "s" in {m["id"] for m in ask_models(srv, admin)}
        r = httpx.get(url, headers={"authorization": f"Bearer {admin}"}, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "r"
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_bad_rollout_or_shadow_stops_the_start_with_one_line(models):
    paths, _ = models
    for args, message in ((("--rollout", "r=tiny:1,nope:1"), "'nope' is not a served model"),
                          (("--shadow", "r=twin"), "'r' is not a served model, alias or rollout")):
        srv = ServerProcess("--model", paths["tiny"], "--model", paths["twin"], *args)
        with pytest.raises(RuntimeError, match="exited early") as e:
            srv.wait_ready(timeout=60)
        assert message in str(e.value) and "Traceback" not in str(e.value)


def ask_models(srv, key: str) -> list[dict]:
    return httpx.get(srv.url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10).json()["data"]


# -- the rollout's decisions, fed by hand -----------------------------------------------------
def _outcome(latency: float) -> Observed:
    o = Observed("r")
    o.arrival, o.first_token, o.last, o.finished = 0.0, latency / 4, latency, 1
    return o


def _rollout(**kw) -> Rollout:
    return Rollout(RolloutSpec("r", "a", "b", (90, 10)), Thresholds(min_requests=10, **kw),
                   RolloutMetrics(CollectorRegistry()))


def test_error_and_latency_rules_need_the_minimum_sample_and_margin():
    r = _rollout(error_margin=0.05)
    for i in range(10):
        r.record(r.stable, True, _outcome(0.1))
        r.record(r.canary, i != 0, _outcome(0.1))  # one error in ten: 10 points above the stable's 0
        assert r.state == ("running" if i < 9 else "rolled_back")
    assert r.canary.weight == 0 and r.decisions[-1]["evidence"]["rule"] == "error_rate"
    r = _rollout(error_margin=0.2)
    for i in range(10):
        r.record(r.stable, True, _outcome(0.1))
        r.record(r.canary, i != 0, _outcome(0.1))
    assert r.state == "running"  # within the margin
    r = _rollout(latency_margin=0.5)
    for _ in range(10):
        r.record(r.stable, True, _outcome(0.1))
        r.record(r.canary, True, _outcome(0.14))  # 1.4x: within 1.5x
    assert r.state == "running"
    r.record(r.canary, True, _outcome(0.2))  # its p99 now 2x the stable's
    assert r.state == "rolled_back" and r.decisions[-1]["evidence"]["rule"] == "p99_latency"
    assert r.decisions[-1]["evidence"]["canary"]["window_p99_latency_s"] == pytest.approx(0.2)


def test_agreement_rolls_back_and_a_healthy_canary_is_promoted():
    r = _rollout(min_agreement=0.8, promote_after=15)
    for i in range(10):
        r.record(r.stable, True, _outcome(0.1))
        r.record(r.canary, True, _outcome(0.1))
        r.record_agreement(i % 3 != 0)  # 6 of 10 agree
    assert r.state == "rolled_back" and r.decisions[-1]["evidence"]["rule"] == "agreement"
    r = _rollout(min_agreement=0.8, promote_after=15)
    for i in range(15):
        r.record(r.stable, True, _outcome(0.1))
        r.record(r.canary, True, _outcome(0.1))
    for i in range(10):
        assert r.state == "running"  # 15 healthy answers, but too few of them checked for agreement
        r.record_agreement(True)
    assert r.state == "promoted" and r.weights() == {"a": 0, "b": 90}
    assert r.decisions[-1]["by"] == "auto" and r.decisions[-1]["evidence"]["rule"] == "healthy"


def test_success_rule_needs_checked_answers_on_both_arms_and_the_margin():
    r = _rollout(success_margin=0.1)
    for i in range(10):
        r.record(r.stable, True, _outcome(0.1), passed=True)
        r.record(r.canary, True, _outcome(0.1))  # unchecked: nothing to compare
    assert r.state == "running" and r.canary.summary()["window_checked"] == 0
    for i in range(10):
        r.record(r.canary, True, _outcome(0.1), passed=i != 0)  # 90%: 10 points below, not more
    assert r.state == "running"
    r.record(r.canary, False, passed=False)  # an error is not a checked answer
    assert r.canary.summary()["window_checked"] == 10
    r.record(r.canary, True, _outcome(0.1), passed=False)  # 9 of 11 now: 18 points below
    assert r.state == "rolled_back"
    evidence = r.decisions[-1]["evidence"]
    assert evidence["rule"] == "success_rate" and evidence["canary"]["window_success_rate"] == pytest.approx(9 / 11)
    assert evidence["stable"]["window_success_rate"] == 1.0
    r = _rollout()  # no success margin: the same answers judge nothing
    for i in range(10):
        r.record(r.stable, True, _outcome(0.1), passed=True)
        r.record(r.canary, True, _outcome(0.1), passed=False)
    assert r.state == "running" and r.canary.summary()["passed"] == 0


def test_promote_then_rollback_gives_the_stable_arm_its_traffic_back():
    r = _rollout()
    r.promote("operator")
    assert r.weights() == {"a": 0, "b": 90} and r.choose("u") is r.canary
    r.rollback("operator")
    assert r.weights() == {"a": 90, "b": 0} and r.choose("u") is r.stable and r.state == "rolled_back"


def test_raising_the_canary_weight_never_moves_a_canary_user_back():
    r = _rollout()
    users = [f"u{i}" for i in range(2000)]
    before = {u for u in users if r.choose(u) is r.canary}
    r.set_weights("running", "operator", canary=30)
    after = {u for u in users if r.choose(u) is r.canary}
    assert before < after and 0.08 < len(before) / 2000 < 0.12 and 0.22 < len(after) / 2000 < 0.28
    assert bucket("r", "u1") == bucket("r", "u1") != bucket("other-rollout", "u1")


def test_specs_are_checked():
    served = ["a", "b"]
    assert parse_rollout("r=a:90,b:10", served) == RolloutSpec("r", "a", "b", (90, 10))
    for bad in ("r=a:90", "r=a:90,c:10", "a=a:90,b:10", "r=a:x,b:1", "r=a:0,b:0", "r=a:1,a:1", "r", "=a:1,b:1", "r@1=a:1,b:1",
                "r r=a:1,b:1", "-r=a:1,b:1"):
        with pytest.raises(ValueError):
            parse_rollout(bad, served)
    assert parse_shadow("r=b:0.25", ["a", "b", "r"], served).fraction == 0.25
    for bad in ("r=b:0", "r=b:1.5", "x=b", "a=a", "r=c", "r=b:half"):
        with pytest.raises(ValueError):
            parse_shadow(bad, ["a", "b", "r"], served)
    for bad in (dict(min_agreement=2.0), dict(min_agreement=0.0), dict(error_margin=1.0), dict(min_requests=0),
                dict(min_requests=501), dict(latency_margin=-0.1), dict(promote_after=-1), dict(success_margin=1.0),
                dict(success_margin=-0.1)):
        with pytest.raises(ValueError):
            Thresholds(**bad)
