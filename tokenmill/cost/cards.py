"""Rate cards: what one model's tokens cost, as a provider publishes it.

A `RateCard` holds list prices in USD per million tokens (`Prices`), optional batch
prices (published, or derived from a documented discount), an optional long-context
rule, and, for self-hosted cards, the machine basis the prices were computed from.
Cards come from TOML/YAML files (`load_cards`); the dated example cards ship in
`tokenmill/cost/cards/`. Prices are `Decimal` so that pricing is exact.

File shape (TOML; YAML mirrors it)::

    [cards."gpt-5.6-sol"]
    provider = "openai"
    model = "gpt-5.6-sol"
    as_of = 2026-12-01
    currency = "USD"                       # the only currency supported
    source = "..."                         # optional
    notes = "..."                          # optional
    [cards."gpt-5.6-sol".prices]           # USD per 1M tokens
    input = 5.00
    cached_input = 0.50                    # cache read
    cache_write = 6.25                     # optional; absent = billed as input
    cache_write_1h = 10.00                 # optional: a write kept an hour; absent = cache_write
    reasoning = 30.00                      # optional; reasoning output tokens (absent = billed as output)
    output = 30.00
    [cards."gpt-5.6-sol".batch]            # optional; absent = no batch price
    input = 2.50                           # either published prices ...
    output = 15.00
    # discount = 0.5                       # ... or a discount off every price
    # assumption = true                    # mark a discount the provider did not publish
    [cards."gpt-5.6-sol".long_context]     # optional
    threshold_tokens = 272000              # prompt tokens above this re-price the request
    input_multiplier = 2
    output_multiplier = 1.5

A self-hosted card replaces `[prices]` with `[machine]` (`usd_per_hour`,
`input_tokens_per_s`, `output_tokens_per_s`, optional `cached_input_ratio`); see
`self_hosted_card`.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace
from decimal import ROUND_HALF_EVEN, Decimal
from importlib import resources
from pathlib import Path
from typing import Any

from tokenmill.cost.values import ConfigError, Fields, read_mapping_file, to_decimal

MILLION = Decimal(1_000_000)
SECONDS_PER_HOUR = Decimal(3600)
# Derived prices (self-hosted, batch prices that follow a ratio) are quotients that
# rarely terminate; rounding them to a micro-dollar per million tokens keeps every
# later product and sum exact.
PRICE_QUANTUM = Decimal("0.000001")
SELF_HOSTED_PROVIDER = "self-hosted"


class CardError(ConfigError):
    """A rate card file or value is invalid."""


@dataclass(frozen=True)
class Prices:
    """USD per 1M tokens. `input` is uncached prompt tokens; `cache_write` None means
    tokens written to the cache are billed at the `input` price; `cache_write_1h` is the
    price of a write kept an hour (Anthropic's 1h TTL; None: `cache_write`)."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_write: Decimal | None = None
    cache_write_1h: Decimal | None = None
    reasoning: Decimal | None = None  # reasoning (thinking) output tokens; None: billed as output

    def scaled(self, input_factor: Decimal, output_factor: Decimal) -> Prices:
        """Input-side prices times `input_factor`, output times `output_factor`."""
        write = None if self.cache_write is None else self.cache_write * input_factor
        write_1h = None if self.cache_write_1h is None else self.cache_write_1h * input_factor
        reasoning = None if self.reasoning is None else self.reasoning * output_factor
        return Prices(self.input * input_factor, self.cached_input * input_factor,
                      self.output * output_factor, write, write_1h, reasoning)


@dataclass(frozen=True)
class LongContext:
    """Past `threshold_tokens` prompt tokens the whole request is re-priced."""

    threshold_tokens: int
    input_multiplier: Decimal
    output_multiplier: Decimal


@dataclass(frozen=True)
class MachineBasis:
    """What a self-hosted card's prices were computed from (kept so they can be redone)."""

    usd_per_hour: Decimal
    input_tokens_per_s: Decimal
    output_tokens_per_s: Decimal
    cached_input_ratio: Decimal = Decimal(0)


@dataclass(frozen=True)
class RateCard:
    name: str
    provider: str
    model: str
    as_of: dt.date
    prices: Prices
    batch: Prices | None = None  # None: no batch price; batch requests pay list
    batch_note: str = ""  # where batch prices came from ("published", "assumed 50% discount")
    long_context: LongContext | None = None
    machine: MachineBasis | None = None  # set only for self-hosted cards
    currency: str = "USD"
    notes: str = ""
    source: str = ""


def per_mtok(usd_per_hour: Decimal, tokens_per_s: Decimal) -> Decimal:
    """USD per 1M tokens for a machine at `usd_per_hour` doing `tokens_per_s`."""
    exact = usd_per_hour * MILLION / (SECONDS_PER_HOUR * tokens_per_s)
    return exact.quantize(PRICE_QUANTUM, rounding=ROUND_HALF_EVEN)


def self_hosted_card(name: str, usd_per_hour: Decimal | float | str, input_tokens_per_s: Decimal | float | str,
                     output_tokens_per_s: Decimal | float | str, *,
                     cached_input_ratio: Decimal | float | str = 0, model: str | None = None,
                     as_of: dt.date | None = None, notes: str = "", source: str = "") -> RateCard:
    """A card priced from machine time: each token kind costs the machine-seconds it takes.

    `input_tokens_per_s` is the prefill rate and `output_tokens_per_s` the decode rate
    the machine sustains (at the concurrency you serve), so a request with `i` input and
    `o` output tokens is charged `usd_per_hour * (i / in_rate + o / out_rate) / 3600`.
    A prefix-cache hit skips prefill, so cached tokens cost `cached_input_ratio` times the
    input price (default 0: the attention over them is already in the decode rate).
    Prices are rounded to 1e-6 USD per 1M tokens. No batch price: a self-hosted batch is
    the same machine time.
    """
    basis = MachineBasis(to_decimal(usd_per_hour), to_decimal(input_tokens_per_s),
                         to_decimal(output_tokens_per_s), to_decimal(cached_input_ratio))
    if basis.usd_per_hour < 0:
        raise CardError(f"card '{name}': machine.usd_per_hour must be >= 0, got {usd_per_hour}")
    for field, value in (("input_tokens_per_s", basis.input_tokens_per_s),
                         ("output_tokens_per_s", basis.output_tokens_per_s)):
        if not value > 0:
            raise CardError(f"card '{name}': machine.{field} must be > 0, got {value}")
    if not 0 <= basis.cached_input_ratio <= 1:
        raise CardError(f"card '{name}': machine.cached_input_ratio must be in [0, 1], "
                        f"got {basis.cached_input_ratio}")
    input_price = per_mtok(basis.usd_per_hour, basis.input_tokens_per_s)
    prices = Prices(input=input_price,
                    cached_input=(input_price * basis.cached_input_ratio).quantize(PRICE_QUANTUM),
                    output=per_mtok(basis.usd_per_hour, basis.output_tokens_per_s))
    return RateCard(name=name, provider=SELF_HOSTED_PROVIDER, model=model or name,
                    as_of=as_of or dt.date.today(), prices=prices, machine=basis, notes=notes, source=source)


def with_machine(card: RateCard, *, usd_per_hour: Decimal | float | str | None = None,
                 input_tokens_per_s: Decimal | float | str | None = None,
                 output_tokens_per_s: Decimal | float | str | None = None) -> RateCard:
    """A self-hosted card re-priced with some of its machine figures replaced.

    This is how a server overrides the placeholder rate of `tokenmill-default` with the
    real cost of the machine it runs on.
    """
    if card.machine is None:
        raise CardError(f"card '{card.name}': not a self-hosted card (no [machine] basis)")
    m = card.machine
    fresh = self_hosted_card(
        card.name,
        m.usd_per_hour if usd_per_hour is None else usd_per_hour,
        m.input_tokens_per_s if input_tokens_per_s is None else input_tokens_per_s,
        m.output_tokens_per_s if output_tokens_per_s is None else output_tokens_per_s,
        cached_input_ratio=m.cached_input_ratio, model=card.model, as_of=card.as_of,
        notes=card.notes, source=card.source)
    return replace(fresh, provider=card.provider)


def find_card(cards: dict[str, RateCard], model: str) -> RateCard | None:
    """The card named `model`, else the first card whose `model` field is `model`."""
    if model in cards:
        return cards[model]
    return next((c for c in cards.values() if c.model == model), None)


# ---- loading ---------------------------------------------------------------------------

_CARD_KEYS = ("provider", "model", "as_of", "currency", "source", "notes",
              "prices", "machine", "batch", "long_context")
_SUFFIXES = (".toml", ".yaml", ".yml")


def load_cards(path: str | Path | None = None) -> dict[str, RateCard]:
    """Cards by name from a card file, or from every card file in a folder.

    None loads the cards shipped with tokenmill. A name defined twice is an error.
    """
    if path is None:
        folder = resources.files("tokenmill.cost") / "cards"
        files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
        with resources.as_file(folder) as real:
            return _load_files([Path(real) / f.name for f in files])
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in _SUFFIXES)
        if not files:
            raise CardError(f"card folder {path}: no .toml/.yaml files")
        return _load_files(files)
    return _load_files([path])


def _load_files(files: list[Path]) -> dict[str, RateCard]:
    cards: dict[str, RateCard] = {}
    for file in files:
        data = read_mapping_file(file, "card file", CardError)
        top = Fields(data, f"card file {file}", CardError)
        top.only(["cards"])
        table = top.raw("cards")
        if not isinstance(table, dict) or not table:
            raise CardError(f"card file {file}: 'cards' must be a non-empty table of cards")
        for name, body in table.items():
            if name in cards:
                raise CardError(f"card '{name}': defined twice (again in {file})")
            cards[name] = parse_card(str(name), body)
    return cards


def parse_card(name: str, body: Any) -> RateCard:
    """One card from its parsed table; raises CardError naming the card and field."""
    f = Fields(body, f"card '{name}'", CardError)
    f.only(_CARD_KEYS)
    currency = f.text("currency", "USD")
    if currency != "USD":
        raise f.fail(f"'currency' must be USD (the only currency supported), got {currency!r}")
    provider, model, as_of = f.text("provider"), f.text("model", name), _date(f, "as_of")
    notes, source = f.text("notes", ""), f.text("source", "")
    prices_f, machine_f = f.sub("prices"), f.sub("machine")
    if (prices_f is None) == (machine_f is None):
        raise f.fail("needs exactly one of [prices] or [machine]")
    if machine_f is not None:
        machine_f.only(("usd_per_hour", "input_tokens_per_s", "output_tokens_per_s", "cached_input_ratio"))
        if f.has("batch"):
            raise f.fail("a [machine] card has no [batch] prices (batch is the same machine time)")
        card = self_hosted_card(
            name, machine_f.number("usd_per_hour"), machine_f.number("input_tokens_per_s", positive=True),
            machine_f.number("output_tokens_per_s", positive=True),
            cached_input_ratio=machine_f.number("cached_input_ratio", Decimal(0), max_value=Decimal(1)),
            model=model, as_of=as_of, notes=notes, source=source)
        return replace(card, provider=provider, long_context=_long_context(f))
    assert prices_f is not None
    prices = _prices(prices_f)
    batch, batch_note = _batch(f, prices)
    return RateCard(name=name, provider=provider, model=model, as_of=as_of, prices=prices, batch=batch,
                    batch_note=batch_note, long_context=_long_context(f), notes=notes, source=source)


def _date(f: Fields, key: str) -> dt.date:
    value = f.raw(key)
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    try:
        return dt.date.fromisoformat(str(value))
    except ValueError:
        raise f.fail(f"'{key}' must be a date like 2026-12-01, got {value!r}") from None


def _prices(p: Fields) -> Prices:
    p.only(("input", "cached_input", "cache_write", "cache_write_1h", "output", "reasoning"))
    return Prices(input=p.number("input"), cached_input=p.number("cached_input"),
                  output=p.number("output"), cache_write=p.optional_number("cache_write"),
                  cache_write_1h=p.optional_number("cache_write_1h"), reasoning=p.optional_number("reasoning"))


def _batch(f: Fields, base: Prices) -> tuple[Prices | None, str]:
    """Batch prices: published ones, with cached/cache-write prices following the input
    ratio unless given, or a discount off every list price."""
    b = f.sub("batch")
    if b is None:
        return None, ""
    b.only(("input", "output", "cached_input", "cache_write", "cache_write_1h", "reasoning", "discount", "assumption"))
    assumed = b.data.get("assumption", False)
    if not isinstance(assumed, bool):
        raise b.fail(f"'batch.assumption' must be true or false, got {assumed!r}")
    if b.has("discount"):
        for key in ("input", "output", "cached_input", "cache_write", "cache_write_1h", "reasoning"):
            if b.has(key):
                raise b.fail(f"give either 'batch.discount' or batch prices, not both (found 'batch.{key}')")
        discount = b.number("discount", max_value=Decimal(1))
        keep = 1 - discount
        note = f"{(discount * 100).normalize():f}% discount" + (" (assumption)" if assumed else "")
        return base.scaled(keep, keep), note
    batch_in, batch_out = b.number("input"), b.number("output")
    if base.input == 0 and not b.has("cached_input"):
        raise b.fail("'batch.cached_input' is required when the list input price is 0")
    cached = b.number("cached_input") if b.has("cached_input") else _follow(base.cached_input, batch_in, base)
    write = b.optional_number("cache_write")
    if write is None and base.cache_write is not None:
        write = _follow(base.cache_write, batch_in, base)
    write_1h = b.optional_number("cache_write_1h")
    if write_1h is None and base.cache_write_1h is not None:
        write_1h = _follow(base.cache_write_1h, batch_in, base)
    reasoning = b.optional_number("reasoning")
    if reasoning is None and base.reasoning is not None:  # follows the batch/list output ratio
        reasoning = (base.reasoning * batch_out / base.output).quantize(PRICE_QUANTUM, rounding=ROUND_HALF_EVEN) \
            if base.output else base.reasoning
    note = "published" + (" (assumption)" if assumed else "")
    return Prices(batch_in, cached, batch_out, write, write_1h, reasoning), note


def _follow(list_price: Decimal, batch_input: Decimal, base: Prices) -> Decimal:
    """`list_price` scaled by batch input / list input, rounded to 1e-6 USD per 1M."""
    return (list_price * batch_input / base.input).quantize(PRICE_QUANTUM, rounding=ROUND_HALF_EVEN)


def _long_context(f: Fields) -> LongContext | None:
    lc = f.sub("long_context")
    if lc is None:
        return None
    lc.only(("threshold_tokens", "input_multiplier", "output_multiplier"))
    return LongContext(threshold_tokens=lc.integer("threshold_tokens", min_value=1),
                       input_multiplier=lc.number("input_multiplier", positive=True),
                       output_multiplier=lc.number("output_multiplier", positive=True))
