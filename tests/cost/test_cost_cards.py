"""Shipped cards carry the quoted list prices; card files are validated strictly."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal as D

import pytest

from tokenmill.cost import CardError, find_card, load_cards, with_machine


def test_shipped_cards_have_the_quoted_list_prices():
    cards = load_cards()
    assert set(cards) == {"gpt-5.6-sol", "claude-opus-5", "claude-haiku-4.5", "gemini-3.5-flash-lite",
                          "tokenmill-default"}
    assert all(c.as_of == dt.date(2026, 12, 1) and c.currency == "USD" for c in cards.values())

    def listed(name):
        p = cards[name].prices
        return (p.input, p.cached_input, p.cache_write, p.output)

    assert listed("gpt-5.6-sol") == (D(5), D("0.5"), None, D(30))
    assert listed("claude-opus-5") == (D(5), D("0.5"), D("6.25"), D(25))
    assert listed("claude-haiku-4.5") == (D(1), D("0.1"), D("1.25"), D(5))
    assert listed("gemini-3.5-flash-lite") == (D("0.3"), D("0.03"), None, D("2.5"))

    gpt = cards["gpt-5.6-sol"]
    assert (gpt.batch.input, gpt.batch.output) == (D("2.5"), D(15))
    lc = gpt.long_context
    assert (lc.threshold_tokens, lc.input_multiplier, lc.output_multiplier) == (272_000, D(2), D("1.5"))
    flash = cards["gemini-3.5-flash-lite"]
    assert (flash.batch.input, flash.batch.output) == (D("0.15"), D("1.25"))
    # no batch price was quoted for the Anthropic cards: none is invented
    assert cards["claude-opus-5"].batch is None and cards["claude-haiku-4.5"].batch is None


def test_default_card_is_self_hosted_and_overridable():
    card = load_cards()["tokenmill-default"]
    assert card.machine is not None and card.provider == "self-hosted"
    # $0.10/h at 1000 in/s and 200 out/s, rounded to 1e-6 $/M
    assert (card.prices.input, card.prices.output) == (D("0.027778"), D("0.138889"))
    real = with_machine(card, usd_per_hour="3.60")
    assert (real.prices.input, real.prices.output) == (D(1), D(5))
    assert real.name == card.name and real.as_of == card.as_of
    with pytest.raises(CardError, match="not a self-hosted card"):
        with_machine(load_cards()["gpt-5.6-sol"], usd_per_hour=1)


def test_find_card_by_name_or_model():
    cards = load_cards()
    assert find_card(cards, "claude-opus-5").name == "claude-opus-5"
    assert find_card(cards, "nope") is None


GOOD = """
[cards.good]
provider = "acme"
as_of = 2026-12-01
[cards.good.prices]
input = 2
cached_input = 0.2
output = 8
"""


def write(tmp_path, text, name="cards.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_minimal_card_loads(tmp_path):
    card = load_cards(write(tmp_path, GOOD))["good"]
    assert card.model == "good" and card.prices.output == D(8) and card.batch is None


@pytest.mark.parametrize("change, message", [
    (("input = 2", "input = -2"), "card 'good': 'prices.input' must be >= 0, got -2"),
    (("input = 2", "inptu = 2"), "card 'good': unknown key 'prices.inptu'"),
    (("output = 8", ""), "card 'good': missing required field 'prices.output'"),
    (("as_of = 2026-12-01", ""), "card 'good': missing required field 'as_of'"),
    (("as_of = 2026-12-01", 'as_of = "soon"'), "card 'good': 'as_of' must be a date"),
    (('provider = "acme"', 'provider = "acme"\ncurrency = "EUR"'), "card 'good': 'currency' must be USD"),
    (('provider = "acme"', 'provider = "acme"\ncolour = "red"'), "card 'good': unknown key 'colour'"),
    (("output = 8", 'output = "lots"'), "card 'good': 'prices.output' must be a number"),
    (("output = 8", "output = true"), "card 'good': 'prices.output' must be a number"),
])
def test_invalid_cards_fail_with_one_line_naming_card_and_field(tmp_path, change, message):
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(CardError) as info:
        load_cards(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_batch_and_long_context_tables_are_checked(tmp_path):
    both = GOOD + "[cards.good.batch]\ninput = 1\noutput = 4\ndiscount = 0.5\n"
    with pytest.raises(CardError, match="either 'batch.discount' or batch prices"):
        load_cards(write(tmp_path, both))
    lc = GOOD + "[cards.good.long_context]\nthreshold_tokens = 0\ninput_multiplier = 2\noutput_multiplier = 1\n"
    with pytest.raises(CardError, match="'long_context.threshold_tokens' must be >= 1"):
        load_cards(write(tmp_path, lc))
    machine = GOOD + "[cards.good.machine]\nusd_per_hour = 1\ninput_tokens_per_s = 1\noutput_tokens_per_s = 1\n"
    with pytest.raises(CardError, match="exactly one of \\[prices\\] or \\[machine\\]"):
        load_cards(write(tmp_path, machine))


def test_assumed_batch_discount_is_marked(tmp_path):
    text = GOOD + "cache_write = 2.5\n[cards.good.batch]\ndiscount = 0.5\nassumption = true\n"
    card = load_cards(write(tmp_path, text))["good"]
    assert card.batch.input == D(1) and card.batch.cached_input == D("0.1") and card.batch.output == D(4)
    assert card.batch.cache_write == D("1.25")
    assert card.batch_note == "50% discount (assumption)"


def test_yaml_cards_and_duplicate_names(tmp_path):
    write(tmp_path, GOOD)
    write(tmp_path, "cards:\n  other:\n    provider: acme\n    as_of: 2026-12-01\n"
                    "    prices: {input: 0.3, cached_input: 0.03, output: 2.5}\n", "more.yaml")
    cards = load_cards(tmp_path)
    assert set(cards) == {"good", "other"} and cards["other"].prices.input == D("0.3")
    write(tmp_path, GOOD, "again.toml")
    with pytest.raises(CardError, match="card 'good': defined twice"):
        load_cards(tmp_path)


def test_unreadable_files_say_so(tmp_path):
    with pytest.raises(CardError, match="no such file"):
        load_cards(tmp_path / "missing.toml")
    with pytest.raises(CardError, match="cannot parse"):
        load_cards(write(tmp_path, "[cards.x\n"))
