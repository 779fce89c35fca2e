"""Workload estimates: exact on fixed workloads, analytic tails checked against sampling."""

from __future__ import annotations

import random
from decimal import Decimal as D

import pytest

from tokenmill.cost import load_cards, price
from tokenmill.cost.distributions import Fixed, LogNormal, Normal, Uniform, parse_distribution
from tokenmill.cost.estimate import Workload, WorkloadError, estimate, estimate_all, load_workload

CARDS = load_cards()
GPT, HAIKU = CARDS["gpt-5.6-sol"], CARDS["claude-haiku-4.5"]


def fixed_workload(**kw):
    base = dict(requests_per_month=D(1000), input_tokens=Fixed(D(1000)), output_tokens=Fixed(D(500)))
    return Workload(**(base | kw))


def test_retry_and_task_success():
    # per request $0.0035 (1000 x $1/M + 500 x $5/M); 10% retried once, billed in full:
    # monthly = 0.0035 x 1000 x 1.1 = 3.85; per successful task = 3.85 / (1000 x 0.8)
    e = estimate(HAIKU, fixed_workload(retry_rate=D("0.1"), task_success_rate=D("0.8")))
    assert e.monthly_usd == D("3.85")
    assert e.usd_per_success == D("0.0048125")
    assert e.input_tokens == D(1_100_000) and e.output_tokens == D(550_000)
    assert (e.usd_per_mtok_input, e.usd_per_mtok_output) == (D(1), D(5))


def test_cache_and_batch_shares_match_per_request_prices():
    # half the input cached, half the requests batched: the mean of four exact prices
    w = fixed_workload(requests_per_month=D(1_000_000), input_tokens=Fixed(D(10_000)),
                       output_tokens=Fixed(D(1000)), cache_hit_rate=D("0.5"), batch_share=D("0.5"))
    listed = price(GPT, input_tokens=10_000, cached_tokens=5_000, output_tokens=1_000)  # 0.0575
    batched = price(GPT, input_tokens=10_000, cached_tokens=5_000, output_tokens=1_000, batch=True)  # 0.02875
    assert (listed.total_usd, batched.total_usd) == (D("0.0575"), D("0.02875"))
    e = estimate(GPT, w)
    assert e.monthly_usd == D(43_125) == (listed.total_usd + batched.total_usd) / 2 * 1_000_000
    assert not e.batch_at_list
    assert estimate(HAIKU, w).batch_at_list  # no batch price: billed at list, flagged


def test_long_context_share_from_the_input_distribution():
    # input uniform on [200000, 400000]: P(> 272000) = 0.64, E[in; in > 272000] = 215040,
    # E[in; in <= 272000] = 84960; output fixed 1000. Per request:
    # 84960 x 5e-6 + 215040 x 10e-6 + 1000 x 0.36 x 30e-6 + 1000 x 0.64 x 45e-6 = 2.6148
    w = fixed_workload(requests_per_month=D(1), input_tokens=Uniform(D(200_000), D(400_000)),
                       output_tokens=Fixed(D(1000)))
    e = estimate(GPT, w)
    assert e.long_context_share == D("0.64")
    assert e.monthly_usd == D("2.6148")


def test_fixed_prompt_at_and_above_threshold():
    at = estimate(GPT, fixed_workload(requests_per_month=D(1), input_tokens=Fixed(D(272_000)),
                                      output_tokens=Fixed(D(1000))))
    above = estimate(GPT, fixed_workload(requests_per_month=D(1), input_tokens=Fixed(D(272_001)),
                                         output_tokens=Fixed(D(1000))))
    assert (at.monthly_usd, at.long_context_share) == (D("1.39"), 0)
    assert estimate(HAIKU, fixed_workload()).long_context_share is None
    assert (above.monthly_usd, above.long_context_share) == (D("2.76501"), 1)


@pytest.mark.parametrize("dist", [Normal(D(3000), D(1500)), LogNormal(7.5, 1.0), Uniform(D(10), D(9000))])
@pytest.mark.parametrize("threshold", [1000, 4000, 20000])
def test_analytic_tails_agree_with_seeded_sampling(dist, threshold):
    rng = random.Random(1234)
    xs = [dist.sample(rng) for _ in range(100_000)]
    p, partial = dist.tail(threshold)
    mc_p = sum(x > threshold for x in xs) / len(xs)
    mc_partial = sum(x for x in xs if x > threshold) / len(xs)
    mc_mean = sum(xs) / len(xs)
    assert float(p) == pytest.approx(mc_p, abs=0.005)
    assert float(partial) == pytest.approx(mc_partial, rel=0.05, abs=float(dist.mean()) * 0.01)
    assert float(dist.mean()) == pytest.approx(mc_mean, rel=0.02)


def test_lognormal_by_mean_keeps_the_mean():
    d = parse_distribution({"distribution": "lognormal", "mean": 2000, "sigma": 1.2}, "w", "input_tokens")
    assert float(d.mean()) == pytest.approx(2000, rel=1e-12)


WORKLOAD = """
name = "support bot"
requests_per_month = 1000
input_tokens = 1000
output_tokens = { distribution = "fixed", value = 500 }
retry_rate = 0.1
task_success_rate = 0.8
cards = ["claude-haiku-4.5"]
[self_hosted]
usd_per_hour = 3.6
input_tokens_per_s = 1000
output_tokens_per_s = 100
"""


def test_workload_file_with_self_hosted_machine(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD)
    w = load_workload(path)
    results = {e.card: e for e in estimate_all(w, CARDS)}
    assert set(results) == {"claude-haiku-4.5", "self-hosted"}
    assert results["claude-haiku-4.5"].monthly_usd == D("3.85")
    # $1 per M in, $10 per M out: (0.001 + 0.005) x 1000 x 1.1
    assert results["self-hosted"].monthly_usd == D("6.6")


def test_yaml_workload_matches_toml(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("requests_per_month: 1000\ninput_tokens: 1000\noutput_tokens: 500\nretry_rate: 0.1\n"
                    "task_success_rate: 0.8\n")
    assert estimate(HAIKU, load_workload(path)).monthly_usd == D("3.85")


@pytest.mark.parametrize("change, message", [
    (("retry_rate = 0.1", "retry_rate = 1.5"), "'retry_rate' must be <= 1"),
    (("task_success_rate = 0.8", "task_success_rate = 0"), "'task_success_rate' must be > 0"),
    (("input_tokens = 1000", ""), "missing required field 'input_tokens'"),
    (("input_tokens = 1000", 'input_tokens = { distribution = "zipf" }'), "must be fixed, uniform, normal"),
    (("input_tokens = 1000", 'input_tokens = { distribution = "uniform", low = 5 }'),
     "missing required field 'input_tokens.high'"),
    (('cards = ["claude-haiku-4.5"]', 'cards = ["gpt-9"]'), "unknown card(s) gpt-9"),
    (("retry_rate = 0.1", "retries = 0.1"), "unknown key 'retries'"),
])
def test_invalid_workloads_name_the_field(tmp_path, change, message):
    path = tmp_path / "w.toml"
    path.write_text(WORKLOAD.replace(*change))
    with pytest.raises(WorkloadError) as info:
        estimate_all(load_workload(path), CARDS)
    assert message in str(info.value)
