"""Operating rollouts (tokenmill/server/traffic.py, rollout_store.py): starting one on a
running server (POST /v1/rollouts, `tokenmill rollout start`), and the decisions kept in
the data directory across restarts. The tiny models are test_rollouts.py's."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.server.conftest import ServerProcess
from tests.server.test_multimodel import KV_GB
from tests.server.test_rollouts import ask, models, status  # noqa: F401  (models: the fixture)
from tokenmill.server.rollouts import parse_rollout

pytest.importorskip("openai")
pytest.importorskip("transformers")


@pytest.mark.slow
def test_rollouts_start_at_run_time_and_decisions_outlive_a_restart(models, tmp_path):
    """POST /v1/rollouts and `tokenmill rollout start` add rollouts to a running server
    (each refused input with its status); with --data-dir, a rollback, a promotion and
    the started rollouts are as they were after a restart with the same flags."""
    paths, _ = models
    args = ("--model", paths["tiny"], "--model", paths["twin"], "--model", paths["other"], "--kv-cache-gb",
            str(KV_GB), "--dtype", "float32", "--data-dir", str(tmp_path / "data"), "--model-alias",
            "nick=tiny", "--rollout", "r=tiny:50,twin:50")
    cli = [sys.executable, "-m", "tokenmill.cli", "rollout"]
    srv = ServerProcess(*args).wait_ready()
    try:
        url = srv.url + "/v1/rollouts"
        r = httpx.post(url, json={"rollout": "new=tiny:80,other:20"}, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "new" and r.json()["canary"] == {**r.json()["canary"], "model": "other", "weight": 20}
        assert r.json()["decisions"][-1]["action"] == "start"
        for bad, code in ((("new=tiny:1,twin:1"), 409), ("tiny=twin:1,other:1", 409), ("nick=twin:1,other:1", 409),
                          ("x=tiny:1,nope:1", 404), ("x=tiny:0,twin:0", 400), ("x=tiny:a,twin:1", 400),
                          ("x=tiny:1,tiny:1", 400), ("x@1=tiny:1,twin:1", 400), ("x y=tiny:1,twin:1", 400), ("x=tiny:1", 400), ("", 400),
                          (f"x=tiny:{10 ** 7},twin:1", 400), (f"x=tiny:{'9' * 5000},twin:1", 400)):
            r = httpx.post(url, json={"rollout": bad}, timeout=10)
            assert r.status_code == code and r.json()["error"]["param"] == "rollout", (bad, r.text)
        for bad in ({"rollout": 5}, {}, {"rollout": "y=tiny:1,twin:1", "more": 1}, [1]):
            assert httpx.post(url, json=bad, timeout=10).status_code == 400, bad
        assert httpx.post(url, content=b"{nope", timeout=10).status_code == 400
        placed = {raw.parse().model for raw in ask(srv, "new", [f"n{i}" for i in range(12)])}
        assert placed == {"tiny", "other"}  # the new name routes at once, to both arms
        assert "new" in {m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]}
        out = subprocess.run([*cli, "start", "again=twin:1,other:1", "--base-url", srv.url], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and "again: started, weights twin=1 other=1" in out.stdout, out.stderr
        out = subprocess.run([*cli, "start", "again=twin:1,other:1", "--base-url", srv.url], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 1 and "409" in out.stderr
        out = subprocess.run([*cli, "abort", "r", "--base-url", srv.url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert httpx.post(url + "/new", json={"action": "promote"}, timeout=10).status_code == 200
        before = status(srv)
    finally:
        srv.stop()
    srv = ServerProcess(*args).wait_ready()  # the same flags, the same data directory
    try:
        after = {r["id"]: r for r in status(srv)["data"]}
        assert after["r"]["state"] == "rolled_back" and (after["r"]["stable"]["weight"],
                                                         after["r"]["canary"]["weight"]) == (50, 0)
        assert after["new"]["state"] == "promoted" and after["new"]["canary"]["weight"] == 80
        assert after["again"]["state"] == "running" and after["again"]["canary"]["model"] == "other"
        for r in before["data"]:  # every decision kept, with its evidence and time
            assert after[r["id"]]["decisions"] == r["decisions"]
        assert {raw.headers["x-tokenmill-rollout"] for raw in ask(srv, "r", [f"r{i}" for i in range(10)])} == {
            "r; arm=stable"}
        assert {raw.parse().model for raw in ask(srv, "new", [f"n{i}" for i in range(6)])} == {"other"}
    finally:
        srv.stop()


def test_a_server_of_several_models_can_start_rollouts_without_the_flag(models):
    from tokenmill.server import launch
    from tokenmill.server.options import ServeOptions

    paths, _ = models
    two = ServeOptions(model=[paths["tiny"], paths["twin"]])
    config = launch._traffic(two, launch._engine(two))  # the engine made, no weights loaded
    assert config is not None and config.rollouts == () and config.data_dir is None
    one = ServeOptions(model=[paths["tiny"]])
    assert launch._traffic(one, launch._engine(one)) is None  # one model: nothing to roll out


def test_kept_rollouts_follow_their_flags_arms_and_the_served_models(tmp_path):
    """rollout_store.py through Traffic: a flag with the kept arms takes the kept state; a
    flag with other arms starts afresh; a started rollout comes back while its models are
    served and its name is free."""
    from tokenmill.server.traffic import Traffic, TrafficConfig

    def traffic(specs, served=("a", "b", "c")) -> Traffic:
        config = TrafficConfig(tuple(parse_rollout(x, list(served)) for x in specs), data_dir=str(tmp_path))
        return Traffic(config, {}, None, CollectorRegistry(), keys_on=False, served=lambda: list(served))

    t = traffic(["r=a:90,b:10"])
    t.rollouts["r"].rollback("operator")
    t.start("s=b:1,c:3", "operator")
    t = traffic(["r=a:90,b:10"])
    assert t.rollouts["r"].state == "rolled_back" and t.rollouts["r"].weights() == {"a": 90, "b": 0}
    assert t.rollouts["s"].weights() == {"b": 1, "c": 3} and t.stable_of == {"r": "a", "s": "b"}
    assert [d["action"] for d in t.rollouts["s"].decisions] == ["start"]
    assert set(traffic(["r=a:90,b:10"], served=("a", "b")).rollouts) == {"r"}  # c is gone: s waits
    t = traffic(["r=a:90,c:10"])  # the flag names other arms now: the flag's rollout, from its first state
    assert t.rollouts["r"].state == "running" and t.rollouts["r"].weights() == {"a": 90, "c": 10}
    assert not t.rollouts["r"].decisions
    t = traffic([])
    assert "r" not in t.rollouts  # a rollout of a flag runs only with its flag
    assert "s" in t.rollouts
