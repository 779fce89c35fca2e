"""The cost of one request under one rate card, exactly.

Token counts follow OpenAI's usage: `input_tokens` is every prompt token
(`usage.prompt_tokens`), `cached_tokens` (cache reads) and `cache_write_tokens`
(tokens written to a prompt cache; `cache_write_1h_tokens` of them kept an hour, at
the card's 1h write price) are parts of it, and the rest are plain input:

    plain = input_tokens - cached_tokens - cache_write_tokens

Rules, applied in this order:

1. **Batch.** A batch request uses the card's batch prices *instead of* its list
   prices. Published batch prices give input and output; cached input and cache write
   under batch follow the batch/list input ratio unless the card states them (OpenAI
   publishes batch cached input that way; the Anthropic batch discount stacks with
   cache prices the same way). A card with no batch price bills batch requests at list,
   never at an invented discount.
2. **Long context.** If `input_tokens` (cached included) is strictly greater than the
   card's `threshold_tokens`, every input-side price (plain, cached, cache write) is
   multiplied by `input_multiplier` and the output price by `output_multiplier`, for
   the whole request, batch or not. Exactly `threshold_tokens` is not long context.
3. **Cache write** with no cache-write price on the card is billed as plain input; a
   1h write with no 1h price, as a cache write. `cache_write_usd` holds both kinds.
4. **Reasoning.** `reasoning_tokens` (thinking, tags included) are part of
   `output_tokens`; they are billed at the card's reasoning price, which is its output
   price unless the card states one (scaled by the same batch and long-context rules).

All arithmetic is `Decimal` at high precision, so each part is exact and
`total_usd` is exactly the sum of the parts. `Cost.to_dict()` is what a response
carries as `usage.cost`.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Any

from tokenmill.cost.cards import MILLION, Prices, RateCard

# Far more digits than any token count times any price needs, so nothing rounds.
_PRECISION = 60


class PricingError(ValueError):
    """Token counts that cannot describe a request (negative, cached > input)."""


@dataclass(frozen=True)
class Rates:
    """USD per single token for one request kind (batch or not, long context or not)."""

    input: Decimal
    cached_input: Decimal
    cache_write: Decimal
    output: Decimal
    reasoning: Decimal
    cache_write_1h: Decimal = Decimal(0)


def is_long_context(card: RateCard, input_tokens: int | Decimal) -> bool:
    lc = card.long_context
    return lc is not None and input_tokens > lc.threshold_tokens


def rates(card: RateCard, *, batch: bool = False, long_context: bool = False) -> Rates:
    """Per-token USD rates after the batch and long-context rules (see module doc)."""
    prices: Prices = card.batch if batch and card.batch is not None else card.prices
    if long_context:
        assert card.long_context is not None, "long_context rates asked of a card without the rule"
        prices = prices.scaled(card.long_context.input_multiplier, card.long_context.output_multiplier)
    write = prices.input if prices.cache_write is None else prices.cache_write
    write_1h = write if prices.cache_write_1h is None else prices.cache_write_1h
    with localcontext(prec=_PRECISION):
        return Rates(input=prices.input / MILLION, cached_input=prices.cached_input / MILLION,
                     cache_write=write / MILLION, output=prices.output / MILLION,
                     cache_write_1h=write_1h / MILLION,
                     reasoning=(prices.output if prices.reasoning is None else prices.reasoning) / MILLION)


@dataclass(frozen=True)
class Cost:
    """What one request cost, in USD, by part; `card` names the rate card used."""

    input_usd: Decimal  # plain (uncached) prompt tokens
    cached_input_usd: Decimal
    cache_write_usd: Decimal
    output_usd: Decimal  # output tokens other than reasoning
    total_usd: Decimal
    card: str
    currency: str = "USD"
    batch: bool = False  # batch prices were used
    long_context: bool = False  # the long-context multipliers were applied
    reasoning_usd: Decimal = Decimal(0)  # reasoning output tokens (in total_usd)

    def to_dict(self, exact: bool = False) -> dict[str, Any]:
        """The `usage.cost` object: USD as floats (nearest double of the exact value),
        or as decimal strings when `exact`."""
        def conv(usd: Decimal) -> float | str:
            return format(usd, "f") if exact else float(usd)

        return {
            "input_usd": conv(self.input_usd),
            "cached_input_usd": conv(self.cached_input_usd),
            "cache_write_usd": conv(self.cache_write_usd),
            "output_usd": conv(self.output_usd),
            "reasoning_usd": conv(self.reasoning_usd),
            "total_usd": conv(self.total_usd),
            "currency": self.currency,
            "card": self.card,
        }


def price(card: RateCard, *, input_tokens: int, cached_tokens: int = 0, cache_write_tokens: int = 0,
          output_tokens: int, reasoning_tokens: int = 0, batch: bool = False,
          cache_write_1h_tokens: int = 0) -> Cost:
    """The exact cost of one request under `card` (rules in the module docstring)."""
    for name, value in (("input_tokens", input_tokens), ("cached_tokens", cached_tokens),
                        ("cache_write_tokens", cache_write_tokens), ("output_tokens", output_tokens),
                        ("reasoning_tokens", reasoning_tokens), ("cache_write_1h_tokens", cache_write_1h_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PricingError(f"{name} must be a non-negative integer, got {value!r}")
    if cache_write_1h_tokens > cache_write_tokens:
        raise PricingError(f"cache_write_1h_tokens ({cache_write_1h_tokens}) are part of cache_write_tokens "
                           f"({cache_write_tokens})")
    if cached_tokens + cache_write_tokens > input_tokens:
        raise PricingError(f"cached_tokens ({cached_tokens}) + cache_write_tokens ({cache_write_tokens}) "
                           f"exceed input_tokens ({input_tokens}), which includes them")
    if reasoning_tokens > output_tokens:
        raise PricingError(f"reasoning_tokens ({reasoning_tokens}) exceed output_tokens ({output_tokens}), "
                           "which includes them")
    long_context = is_long_context(card, input_tokens)
    r = rates(card, batch=batch, long_context=long_context)
    plain = input_tokens - cached_tokens - cache_write_tokens
    with localcontext(prec=_PRECISION):
        write = (cache_write_tokens - cache_write_1h_tokens) * r.cache_write + cache_write_1h_tokens * r.cache_write_1h
        parts = (plain * r.input, cached_tokens * r.cached_input, write, (output_tokens - reasoning_tokens) * r.output)
        reasoning = reasoning_tokens * r.reasoning
        total = sum(parts, reasoning)
    return Cost(*parts, total_usd=total, card=card.name, currency=card.currency,
                batch=batch and card.batch is not None, long_context=long_context, reasoning_usd=reasoning)
