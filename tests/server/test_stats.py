"""GET /v1/stats (the console's dashboard): the rolling window, tenant scoping, and
totals that equal /metrics."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

from tests.server.conftest import MODEL, ServerProcess, add_key, metric
from tokenmill.engine.api import RequestOutput, RequestTimes
from tokenmill.server.stats import StatsWindow


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def output(new: int, *, finished=False, index=0, prompt=10, cached=0, times=None) -> RequestOutput:
    return RequestOutput("r", index, list(range(new)), "x" * new, finished, "stop" if finished else None, None,
                         prompt, cached, new, times=times)


def test_window_rates_percentiles_and_tenant_scope():
    clock = Clock()
    w = StatsWindow(clock=clock, bucket_s=5.0, horizon_s=60.0)
    # tenant a: prompt 10 tokens (4 cached), 3 + 2 output tokens, ttft 0.5 s, gaps 0.1 and 0.3
    w.observe("a", output(3, prompt=10, cached=4), first=True)
    times = RequestTimes(arrival=0.0, first_scheduled=0.1, first_token=0.5, tokens=[0.5, 0.6, 0.9], finished=0.9)
    w.observe("a", output(2, finished=True, times=times), first=False)
    w.settle("a", 200, {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}},
             0.25)
    clock.t += 5.0  # the next bucket
    w.observe("b", output(7, prompt=20, finished=True,
                          times=RequestTimes(arrival=0.0, first_token=2.0, tokens=[2.0, 3.0])), first=True)
    w.settle("b", 429, None, None)
    clock.t += 1.0

    series, s = w.series(None, 60.0)
    assert s["prompt_tokens"] == 30 and s["output_tokens"] == 12
    assert s["output_tps"] == pytest.approx(12 / 60.0)
    assert s["requests"] == 2 and s["errors"] == 1 and s["requests_by_status"] == {"200": 1, "429": 1}
    assert s["ttft_p50"] == pytest.approx(np.percentile([0.5, 2.0], 50))
    assert s["itl_p50"] == pytest.approx(np.percentile([0.1, 0.3, 1.0], 50))
    assert len(series["t"]) == 12 and series["bucket_s"] == 5.0
    assert series["output_tps"][-2] == pytest.approx(5 / 5.0)  # a's bucket, whole
    assert series["output_tps"][-1] == pytest.approx(7 / 1.0)  # b's bucket, one second elapsed
    assert series["ttft_p50"][-3] is None  # an empty bucket has no percentile

    _, a = w.series("a", 60.0)
    assert a["prompt_tokens"] == 10 and a["output_tokens"] == 5 and a["requests_by_status"] == {"200": 1}
    assert a["ttft_p99"] == pytest.approx(0.5)
    assert w.totals["a"].cached_tokens == 4 and w.totals["a"].cost_usd == pytest.approx(0.25)
    assert w.totals["b"].errors == 1 and w.totals["b"].requests == 1

    _, short = w.series(None, 1.0)  # only the current bucket
    assert short["output_tokens"] == 7
    clock.t += 120.0  # past the horizon: the window is empty again
    _, later = w.series(None, 60.0)
    assert later["output_tokens"] == 0 and later["ttft_p50"] is None


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    db = tmp_path_factory.mktemp("stats-keys") / "keys.db"
    keys = {"admin": add_key(db, "ops", "--admin"), "a": add_key(db, "alice", "--rpm", "100", "--tpm", "50000"),
            "b": add_key(db, "bob", "--budget-usd", "5")}
    listing = subprocess.run([sys.executable, "-m", "tokenmill.cli", "keys", "list", "--db", str(db)],
                             capture_output=True, text=True, timeout=60).stdout
    assert "tenant ops (admin)" in listing and "tenant alice:" in listing
    srv = ServerProcess("--keys-db", str(db)).wait_ready()
    yield srv, keys
    srv.stop()


def chat(srv, key, max_tokens=6):
    return httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}],
                            "max_tokens": max_tokens, "temperature": 0})


def stats(srv, key, **params):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(srv.url + "/v1/stats", headers=h, params=params, timeout=30)


def test_tenant_sees_itself_admin_sees_all_and_metrics_agree(keyed):
    srv, keys = keyed
    a1, a2, b1 = chat(srv, keys["a"]), chat(srv, keys["a"], 4), chat(srv, keys["b"])
    assert a1.status_code == a2.status_code == b1.status_code == 200

    mine = stats(srv, keys["a"]).json()
    assert mine["scope"] == "tenant" and mine["tenant"] == "alice"
    assert "engine" not in mine and "totals" not in mine  # the server's state is the admin's to see
    assert [t["tenant"] for t in mine["tenants"]] == ["alice"]
    row = mine["tenants"][0]
    assert row["requests"] == 2
    assert row["completion_tokens"] == a1.json()["usage"]["completion_tokens"] + a2.json()["usage"]["completion_tokens"]
    assert row["cost_usd"] == pytest.approx(a1.json()["usage"]["cost"]["total_usd"] + a2.json()["usage"]["cost"]["total_usd"])
    assert row["headroom"]["requests_per_minute"]["limit"] == 100
    assert row["headroom"]["requests_per_minute"]["remaining"] <= 98
    assert mine["window"]["output_tokens"] == row["completion_tokens"]  # only alice's traffic
    assert mine["window"]["requests_by_status"] == {"200": 2}

    bob = stats(srv, keys["b"]).json()
    assert bob["tenants"][0]["headroom"]["spend"]["budget_usd"] == 5
    assert bob["tenants"][0]["headroom"]["spend"]["spent_usd"] == pytest.approx(b1.json()["usage"]["cost"]["total_usd"])

    admin = stats(srv, keys["admin"]).json()
    assert admin["scope"] == "server"
    assert {t["tenant"] for t in admin["tenants"]} == {"ops", "alice", "bob"}
    totals = admin["totals"]
    assert totals["generation_tokens"] == metric(srv, "tokenmill_generation_tokens_total")
    assert totals["prompt_tokens"] == metric(srv, "tokenmill_prompt_tokens_total")
    assert totals["responses_by_status"]["200"] >= 3
    assert admin["engine"]["kv_blocks_total"] == metric(srv, "tokenmill_kv_blocks_total")
    assert admin["engine"]["running"] == 0
    assert admin["window"]["requests"] >= 3 and admin["window"]["ttft_p50"] > 0
    assert "batches" in admin


def test_stats_needs_a_key_and_a_sane_window(keyed):
    srv, keys = keyed
    assert stats(srv, None).status_code == 401
    assert stats(srv, "tm-wrong").status_code == 401
    r = stats(srv, keys["a"], window=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "window"
    assert stats(srv, keys["a"], window=100000).status_code == 400
    assert stats(srv, keys["a"], window="abc").status_code == 400
