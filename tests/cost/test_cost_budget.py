"""Per-tenant spend budgets: refuse once spent, say when to retry, reset per window."""

from __future__ import annotations

import threading
from decimal import Decimal as D

import pytest

from tokenmill.cost import BudgetExhausted, Ledger, SpendBudget, load_cards, price


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_spend_up_to_the_limit_then_retry_after_the_window():
    clock = FakeClock(7200 + 100)  # 100 s into an hourly window
    ledger = Ledger(default=SpendBudget(D("1.00"), 3600), clock=clock)
    assert ledger.check("acme") is None
    ledger.record("acme", D("0.60"))
    assert ledger.check("acme") is None
    ledger.record("acme", "0.39")
    assert ledger.check("acme") is None  # 0.99 < 1.00: still admitted
    assert ledger.remaining("acme") == D("0.01")
    assert ledger.record("acme", D("0.01")) == D("1.00")
    clock.now += 50
    refused = ledger.check("acme")
    assert isinstance(refused, BudgetExhausted)
    assert (refused.spent_usd, refused.limit_usd, refused.retry_after_s) == (D("1.00"), D("1.00"), 3450.0)
    assert refused.retry_after_header == "3450" and "acme" in refused.message()
    assert ledger.remaining("acme") == 0
    # the window rolls over at 10800: spend resets
    clock.now = 10_800
    assert ledger.check("acme") is None and ledger.spent("acme") == 0


def test_overshoot_by_an_in_flight_request_still_refuses_next():
    ledger = Ledger(default=SpendBudget(D("0.01"), 60), clock=FakeClock(0))
    ledger.record("t", D("0.25"))  # one expensive request finished past the limit
    refused = ledger.check("t")
    assert refused is not None and refused.retry_after_s == 60.0
    assert ledger.remaining("t") == 0


def test_tenants_are_separate_and_per_tenant_budgets_override():
    clock = FakeClock(0)
    ledger = Ledger({"big": SpendBudget(D(100), 86_400)}, default=SpendBudget(D(1), 86_400), clock=clock)
    ledger.record("small", D(1))
    ledger.record("big", D(1))
    assert ledger.check("small") is not None
    assert ledger.check("big") is None
    assert ledger.check("other") is None


def test_tenant_without_budget_is_never_refused_but_still_metered():
    ledger = Ledger(clock=FakeClock(0))
    ledger.record("free", D(1_000_000))
    assert ledger.check("free") is None and ledger.remaining("free") is None
    assert ledger.spent("free") == D(1_000_000)


def test_records_priced_costs_exactly():
    card = load_cards()["claude-haiku-4.5"]
    # each request: 1000 x $1/M + 500 x $5/M = $0.0035; budget $0.01 admits 3 requests (0.0105 spent)
    ledger = Ledger(default=SpendBudget(D("0.01"), 3600), clock=FakeClock(0))
    admitted = 0
    while ledger.check("t") is None:
        ledger.record("t", price(card, input_tokens=1000, output_tokens=500).total_usd)
        admitted += 1
    assert admitted == 3 and ledger.spent("t") == D("0.0105")


def test_concurrent_records_lose_nothing():
    ledger = Ledger(default=SpendBudget(D(10**6), 3600), clock=FakeClock(0))

    def spend():
        for _ in range(2000):
            ledger.record("t", D("0.001"))

    threads = [threading.Thread(target=spend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.spent("t") == D(16)


def test_bad_budgets_and_spend_are_refused():
    with pytest.raises(ValueError, match="limit_usd"):
        SpendBudget(D(-1), 60)
    with pytest.raises(ValueError, match="period_s"):
        SpendBudget(D(1), 0)
    with pytest.raises(ValueError, match="negative spend"):
        Ledger(clock=FakeClock(0)).record("t", D(-1))
