"""Exact per-request prices on worked examples; expected figures are computed by hand."""

from __future__ import annotations

from decimal import Decimal as D

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.cost import PricingError, load_cards, price, self_hosted_card

CARDS = load_cards()
GPT = CARDS["gpt-5.6-sol"]  # in 5, cached 0.5, out 30; batch 2.5/15; >272000: x2 in, x1.5 out
OPUS = CARDS["claude-opus-5"]  # in 5, read 0.5, write 6.25, out 25
HAIKU = CARDS["claude-haiku-4.5"]  # in 1, read 0.10, write 1.25, out 5
FLASH = CARDS["gemini-3.5-flash-lite"]  # in 0.30, cached 0.03, out 2.50; batch 0.15/1.25


def parts(cost):
    return (cost.input_usd, cost.cached_input_usd, cost.cache_write_usd, cost.output_usd, cost.total_usd)


def test_plain_request():
    # 1000 x $1/M + 500 x $5/M
    cost = price(HAIKU, input_tokens=1000, output_tokens=500)
    assert parts(cost) == (D("0.001"), 0, 0, D("0.0025"), D("0.0035"))
    assert cost.card == "claude-haiku-4.5" and not cost.batch and not cost.long_context


def test_cache_hit_prices_cached_tokens_at_a_tenth():
    # input_tokens includes the cached ones: 2000 plain x $5/M, 8000 cached x $0.50/M, 200 x $30/M
    cost = price(GPT, input_tokens=10_000, cached_tokens=8_000, output_tokens=200)
    assert parts(cost) == (D("0.01"), D("0.004"), 0, D("0.006"), D("0.02"))
    # the same request without the hit: 10000 x $5/M + 0.006
    assert price(GPT, input_tokens=10_000, output_tokens=200).total_usd == D("0.056")


def test_cache_write_then_read_on_anthropic():
    # write: 1000 plain x $5/M + 9000 written x $6.25/M + 100 x $25/M
    write = price(OPUS, input_tokens=10_000, cache_write_tokens=9_000, output_tokens=100)
    assert parts(write) == (D("0.005"), 0, D("0.05625"), D("0.0025"), D("0.06375"))
    # read: 1000 x $5/M + 9000 x $0.50/M + 0.0025
    read = price(OPUS, input_tokens=10_000, cached_tokens=9_000, output_tokens=100)
    assert parts(read) == (D("0.005"), D("0.0045"), 0, D("0.0025"), D("0.012"))


def test_cache_write_without_a_write_price_is_billed_as_input():
    assert price(GPT, input_tokens=1000, cache_write_tokens=1000, output_tokens=0).cache_write_usd == D("0.005")


def test_prompt_at_threshold_is_list_price():
    # exactly 272000 is not "above": 272000 x $5/M + 1000 x $30/M
    cost = price(GPT, input_tokens=272_000, output_tokens=1_000)
    assert parts(cost) == (D("1.36"), 0, 0, D("0.03"), D("1.39"))
    assert not cost.long_context


def test_prompt_one_above_threshold_reprices_the_whole_request():
    # every token re-priced: 272001 x $10/M + 1000 x $45/M
    cost = price(GPT, input_tokens=272_001, output_tokens=1_000)
    assert parts(cost) == (D("2.72001"), 0, 0, D("0.045"), D("2.76501"))
    assert cost.long_context
    # cached tokens count toward the threshold and are re-priced too (x2 of $0.50/M)
    cached = price(GPT, input_tokens=272_001, cached_tokens=200_000, output_tokens=1_000)
    assert parts(cached) == (D("0.72001"), D("0.2"), 0, D("0.045"), D("0.96501"))


def test_batch_request():
    # batch prices replace list; cached follows the batch/list ratio: $2.50, $0.25, $15 per M
    cost = price(GPT, input_tokens=100_000, cached_tokens=20_000, output_tokens=10_000, batch=True)
    assert parts(cost) == (D("0.2"), D("0.005"), 0, D("0.15"), D("0.355"))
    assert cost.batch
    # Gemini batch: 1M x $0.15 + 1M x $1.25
    assert price(FLASH, input_tokens=1_000_000, output_tokens=1_000_000, batch=True).total_usd == D("1.40")
    assert price(FLASH, input_tokens=1_000_000, output_tokens=1_000_000).total_usd == D("2.80")


def test_batch_and_long_context_stack():
    # 300000 x ($2.50 x 2)/M + 1000 x ($15 x 1.5)/M
    cost = price(GPT, input_tokens=300_000, output_tokens=1_000, batch=True)
    assert parts(cost) == (D("1.5"), 0, 0, D("0.0225"), D("1.5225"))


def test_card_without_batch_price_bills_batch_at_list():
    assert price(HAIKU, input_tokens=1000, output_tokens=500, batch=True).total_usd == D("0.0035")
    assert not price(HAIKU, input_tokens=1000, output_tokens=500, batch=True).batch


def test_self_hosted_card_prices_machine_seconds():
    # $3.60/h = $0.001/s; 1000 in/s -> $1 per M in; 100 out/s -> $10 per M out
    card = self_hosted_card("box", "3.60", 1000, 100)
    assert (card.prices.input, card.prices.output, card.prices.cached_input) == (D(1), D(10), D(0))
    cost = price(card, input_tokens=1000, output_tokens=100)  # 1 s prefill + 1 s decode = $0.002
    assert cost.total_usd == D("0.002")


def test_bad_token_counts_are_refused():
    with pytest.raises(PricingError, match="exceed input_tokens"):
        price(GPT, input_tokens=10, cached_tokens=8, cache_write_tokens=3, output_tokens=0)
    with pytest.raises(PricingError, match="output_tokens"):
        price(GPT, input_tokens=10, output_tokens=-1)
    with pytest.raises(PricingError, match="input_tokens"):
        price(GPT, input_tokens=1.5, output_tokens=1)  # type: ignore[arg-type]


def test_to_dict_is_the_usage_cost_object():
    d = price(GPT, input_tokens=10_000, cached_tokens=8_000, output_tokens=200).to_dict()
    assert d == {"input_usd": 0.01, "cached_input_usd": 0.004, "cache_write_usd": 0.0, "output_usd": 0.006,
                 "reasoning_usd": 0.0, "total_usd": 0.02, "currency": "USD", "card": "gpt-5.6-sol"}
    exact = price(GPT, input_tokens=272_001, output_tokens=1_000).to_dict(exact=True)
    assert exact["total_usd"] == "2.765010" and D(exact["input_usd"]) + D(exact["output_usd"]) == D("2.76501")


def test_reasoning_tokens_are_billed_as_output_unless_the_card_says(tmp_path):
    plain = price(GPT, input_tokens=1000, output_tokens=1000)
    split = price(GPT, input_tokens=1000, output_tokens=1000, reasoning_tokens=400)
    assert split.total_usd == plain.total_usd  # no reasoning price: the output price
    assert split.reasoning_usd == D("0.012") and split.output_usd == D("0.018")
    f = tmp_path / "cards.toml"
    f.write_text('[cards.thinker]\nprovider = "x"\nmodel = "thinker"\nas_of = 2026-12-01\n'
                 '[cards.thinker.prices]\ninput = 1\ncached_input = 0.1\noutput = 4\nreasoning = 2\n'
                 '[cards.thinker.batch]\ninput = 0.5\noutput = 2\n')
    card = load_cards(f)["thinker"]
    c = price(card, input_tokens=0, output_tokens=1_000_000, reasoning_tokens=250_000)
    assert (c.output_usd, c.reasoning_usd, c.total_usd) == (D(3), D("0.5"), D("3.5"))
    b = price(card, input_tokens=0, output_tokens=1_000_000, reasoning_tokens=250_000, batch=True)
    assert b.reasoning_usd == D("0.25")  # the reasoning price follows the batch/list output ratio
    with pytest.raises(PricingError, match="reasoning_tokens"):
        price(GPT, input_tokens=1, output_tokens=2, reasoning_tokens=3)


@given(card=st.sampled_from(sorted(CARDS)), plain=st.integers(0, 2_000_000), cached=st.integers(0, 2_000_000),
       write=st.integers(0, 2_000_000), out=st.integers(0, 500_000), batch=st.booleans())
def test_total_is_exactly_the_sum_of_parts_and_the_formula(card, plain, cached, write, out, batch):
    c = CARDS[card]
    total_in = plain + cached + write
    cost = price(c, input_tokens=total_in, cached_tokens=cached, cache_write_tokens=write, output_tokens=out,
                 batch=batch)
    assert cost.total_usd == cost.input_usd + cost.cached_input_usd + cost.cache_write_usd + cost.output_usd
    p = c.batch if batch and c.batch else c.prices
    mi = mo = D(1)
    if c.long_context and total_in > c.long_context.threshold_tokens:
        mi, mo = c.long_context.input_multiplier, c.long_context.output_multiplier
    write_price = p.input if p.cache_write is None else p.cache_write
    expected = (plain * p.input + cached * p.cached_input + write * write_price) * mi + out * p.output * mo
    assert cost.total_usd * 1_000_000 == expected
