"""Cache writes priced by TTL: Anthropic's 5-minute write at 1.25x input, the 1-hour write
at 2x, reads at 0.1x, as the shipped card states them."""

from __future__ import annotations

from decimal import Decimal as D

import pytest

from tokenmill.cost import load_cards, price
from tokenmill.cost.pricing import PricingError


def test_haiku_writes_by_ttl_and_reads():
    card = load_cards()["claude-haiku-4.5"]
    assert (card.prices.cache_write, card.prices.cache_write_1h) == (D("1.25"), D("2.00"))
    c = price(card, input_tokens=10_000, cached_tokens=2_000, cache_write_tokens=5_000,
              cache_write_1h_tokens=3_000, output_tokens=100)
    assert c.input_usd == D(3_000) * D("1.00") / 10 ** 6
    assert c.cached_input_usd == D(2_000) * D("0.10") / 10 ** 6
    assert c.cache_write_usd == (D(2_000) * D("1.25") + D(3_000) * D("2.00")) / 10 ** 6
    assert c.total_usd == c.input_usd + c.cached_input_usd + c.cache_write_usd + D(100) * D("5.00") / 10 ** 6


def test_a_card_without_a_1h_price_bills_it_as_a_write():
    card = load_cards()["tokenmill-default"]
    assert card.prices.cache_write_1h is None
    a = price(card, input_tokens=1000, cache_write_tokens=400, cache_write_1h_tokens=400, output_tokens=0)
    b = price(card, input_tokens=1000, cache_write_tokens=400, output_tokens=0)
    assert a == b


def test_1h_writes_are_part_of_the_writes():
    card = load_cards()["claude-haiku-4.5"]
    with pytest.raises(PricingError, match="part of cache_write_tokens"):
        price(card, input_tokens=1000, cache_write_tokens=10, cache_write_1h_tokens=20, output_tokens=0)
