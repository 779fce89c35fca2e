"""Spend alarms per key (tenant) and per server: a spend rate over a trailing window that
logs, counts in /metrics and, where asked, refuses requests until it clears."""

from __future__ import annotations

import time
import types
from decimal import Decimal

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, add_key
from tokenmill.cost import SpendAlarm
from tokenmill.engine.api import EngineStats
from tokenmill.server.errors import APIError
from tokenmill.server.gate import Gate
from tokenmill.server.keys import Tenant, TenantLimits
from tokenmill.server.metrics import Metrics

TINY = "0.000000001"  # any priced request exceeds it


@pytest.fixture(scope="module")
def alarmed(tmp_path_factory):
    db = tmp_path_factory.mktemp("keys") / "keys.db"
    keys = {
        "blocked": add_key(db, "blocked", "--alarm-usd", TINY, "--alarm-window", "3", "--alarm-block"),
        "watched": add_key(db, "watched", "--alarm-usd", TINY, "--alarm-window", "600"),
        "plain": add_key(db, "plain"),
    }
    srv = ServerProcess("--keys-db", str(db), "--log-level", "info", "--spend-alarm-usd", TINY,
                        "--spend-alarm-window", "600").wait_ready()
    yield srv, keys
    srv.stop()


def chat(srv, key):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def series(srv, name: str, scope: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{scope="{scope}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_blocking_key_alarm_refuses_until_its_window_lets_the_spend_go(alarmed):
    srv, keys = alarmed
    assert chat(srv, keys["blocked"]).status_code == 200  # nothing spent before it: admitted
    r = chat(srv, keys["blocked"])
    assert r.status_code == 429 and r.json()["error"]["code"] == "spend_alarm"
    assert "tenant:blocked" in r.json()["error"]["message"]
    wait = int(r.headers["Retry-After"])
    assert 1 <= wait <= 4  # a 3 s window (plus its last bucket)
    assert series(srv, "tokenmill_spend_alarms_total", "tenant:blocked") == 1
    assert series(srv, "tokenmill_spend_alarm_active", "tenant:blocked") == 1
    assert series(srv, "tokenmill_spend_alarm_refusals_total", "tenant:blocked") == 1
    assert series(srv, "tokenmill_spend_alarm_window_usd", "tenant:blocked") > float(TINY)
    time.sleep(wait + 0.2)
    assert chat(srv, keys["blocked"]).status_code == 200  # cleared: the spend left the window
    assert series(srv, "tokenmill_spend_alarms_total", "tenant:blocked") == 2  # and the new spend raised it again


def test_a_watching_alarm_logs_and_counts_but_serves(alarmed):
    srv, keys = alarmed
    for _ in range(3):
        assert chat(srv, keys["watched"]).status_code == 200
    assert series(srv, "tokenmill_spend_alarms_total", "tenant:watched") == 1  # raised once, stays raised
    assert series(srv, "tokenmill_spend_alarm_active", "tenant:watched") == 1
    assert series(srv, "tokenmill_spend_alarm_refusals_total", "tenant:watched") == 0
    # the server's alarm sums every tenant; it does not block, so others are served
    assert chat(srv, keys["plain"]).status_code == 200
    assert series(srv, "tokenmill_spend_alarms_total", "server") == 1
    assert series(srv, "tokenmill_spend_alarm_active", "server") == 1
    assert series(srv, "tokenmill_spend_alarms_total", "tenant:plain") == 0  # no alarm of its own


def test_alarms_are_logged_with_their_evidence(alarmed):
    srv, keys = alarmed
    chat(srv, keys["watched"])
    chat(srv, keys["blocked"])  # raises the blocking alarm (if the window had let it clear)
    time.sleep(4.2)  # past its 3 s window and last bucket
    assert chat(srv, keys["blocked"]).status_code == 200  # the admission that sees it cleared
    log = srv.stop()
    assert "spend alarm for tenant:watched: $" in log and "spent in the last 600s exceeds $0.000000001" in log
    assert "spend alarm for tenant:blocked" in log and "refusing new requests until it clears" in log
    assert "spend alarm for server" in log
    assert "spend alarm for tenant:blocked cleared" in log


def test_a_blocking_server_alarm_refuses_every_tenant():
    stats = EngineStats
    gate = Gate(TenantLimits(), stats, Metrics(stats), server_alarm=SpendAlarm(Decimal("0.01"), 60, block=True))

    def admit(name: str) -> None:
        ctx = types.SimpleNamespace(finalizers=[], rate_limited=True, deadline=None)
        gate.admit(ctx, Tenant(name, TenantLimits()), None, None)

    admit("a")
    gate.ledger.record("a", Decimal("0.02"))  # one tenant's spend raises the server's alarm
    with pytest.raises(APIError) as err:
        admit("b")
    assert err.value.status == 429 and err.value.code == "spend_alarm"
    assert "server" in str(err.value.message)
