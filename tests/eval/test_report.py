"""The report's statistics and costs, from hand-built runs."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest

from tokenmill.cost import load_cards, price
from tokenmill.eval.report import Z95, summary, table, wilson
from tokenmill.eval.runner import Answer, Target, TargetRun


@pytest.mark.parametrize("k,n", [(0, 10), (2, 16), (8, 16), (16, 16), (1, 1), (37, 200)])
def test_wilson_bounds_are_the_roots_of_the_score_equation(k, n):
    # The Wilson interval is the set of p with |k/n - p| <= z * sqrt(p (1 - p) / n): its ends
    # solve that with equality (or sit at 0 / 1).
    lo, hi = wilson(k, n)
    p_hat = k / n
    for p in (lo, hi):
        if 0 < p < 1:
            assert abs(p_hat - p) == pytest.approx(Z95 * math.sqrt(p * (1 - p) / n), rel=1e-9)
    assert 0 <= lo <= p_hat <= hi <= 1
    assert (lo == 0) == (k == 0) and (hi == 1) == (k == n)


def _run(passed: list[bool], busy_s: float) -> TargetRun:
    answers = [Answer(task_id=f"t{i}", kind="short", ok=True, text="x", prompt_tokens=100 + i, completion_tokens=10,
                      cached_tokens=50 if i == 0 else 0, latency_s=0.1 * (i + 1), passed=p)
               for i, p in enumerate(passed)]
    answers.append(Answer(task_id="failed", kind="code", ok=False, error="http_500", latency_s=5.0))
    return TargetRun(Target("cfg", "http://x"), "m", answers, busy_s=busy_s)


def test_costs_per_success_both_ways():
    card = load_cards()["gpt-5.6-sol"]
    run = _run([True, False, True, True], busy_s=90.0)
    s = summary(run, card, usd_per_hour=2.0)
    assert (s["tasks"], s["passed"], s["request_errors"]) == (5, 3, 1)
    expected = sum((price(card, input_tokens=a.prompt_tokens, cached_tokens=a.cached_tokens,
                          output_tokens=a.completion_tokens).total_usd for a in run.answers if a.ok), Decimal(0))
    assert s["card_usd"] == pytest.approx(float(expected)) and s["unpriced_answers"] == 1
    assert s["card_usd_per_success"] == pytest.approx(float(expected) / 3)
    assert s["machine_usd_per_success"] == pytest.approx(2.0 * 90 / 3600 / 3)
    assert s["latency_s"]["p50"] == pytest.approx(0.25)  # successful requests only
    assert s["by_kind"] == {"short": {"tasks": 4, "passed": 3}, "code": {"tasks": 1, "passed": 0}}
    row = table({"configs": [s]})
    assert "| cfg | m | 3/5 | 60% (" in row


def test_no_success_has_no_cost_per_success():
    s = summary(_run([False], busy_s=10.0), load_cards()["gpt-5.6-sol"], usd_per_hour=1.0)
    assert s["passed"] == 0 and s["card_usd_per_success"] is None and s["machine_usd_per_success"] is None
    assert s["machine_usd"] == pytest.approx(10 / 3600)
