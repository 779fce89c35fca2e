"""Monthly cost of a described workload under each rate card.

A workload file (TOML or YAML)::

    name = "support bot"                   # optional
    requests_per_month = 1_000_000
    input_tokens = { distribution = "lognormal", mean = 3000, sigma = 1.0 }
    output_tokens = 400                     # a bare number: every request the same
    cache_hit_rate = 0.5                    # share of input tokens read from cache
    cache_write_rate = 0.0                  # share of input tokens written to cache (optional)
    batch_share = 0.2                       # share of requests sent as batch
    retry_rate = 0.05                       # share of requests retried once, billed in full
    task_success_rate = 0.9                 # share of requests whose task succeeds
    cards = ["gpt-5.6-sol", "claude-haiku-4.5"]   # optional; default every card
    [self_hosted]                           # optional: adds a "self-hosted" card
    usd_per_hour = 2.0
    input_tokens_per_s = 5000
    output_tokens_per_s = 400

Method (analytic; no sampling):
- Per request, cache hits and writes are fixed shares of its input tokens, batch is a
  share of requests independent of size, and input and output lengths are independent.
- Pricing is linear in tokens except for the long-context rule, so the expected cost
  of one request is, over the two regimes "prompt <= T" and "prompt > T",
  `E[in * 1{regime}] * input_rate + E[out] * P(regime) * output_rate`, with the
  partial moments from `Distribution.tail(T)` (closed forms). This is exact for the
  stated distributions, not a Monte Carlo estimate.
- monthly = E[cost per request] * requests_per_month * (1 + retry_rate)
- per successful task = monthly / (requests_per_month * task_success_rate)
A card without batch prices bills the batch share at list (flagged in the result).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, localcontext
from pathlib import Path

from tokenmill.cost.cards import MILLION, MachineBasis, RateCard, self_hosted_card
from tokenmill.cost.distributions import Distribution, parse_distribution
from tokenmill.cost.pricing import rates
from tokenmill.cost.values import ConfigError, Fields, read_mapping_file

SELF_HOSTED_NAME = "self-hosted"
_KEYS = ("name", "requests_per_month", "input_tokens", "output_tokens", "cache_hit_rate", "cache_write_rate",
         "batch_share", "retry_rate", "task_success_rate", "cards", "self_hosted")


class WorkloadError(ConfigError):
    """A workload description is invalid."""


@dataclass(frozen=True)
class Workload:
    requests_per_month: Decimal
    input_tokens: Distribution
    output_tokens: Distribution
    cache_hit_rate: Decimal = Decimal(0)
    cache_write_rate: Decimal = Decimal(0)
    batch_share: Decimal = Decimal(0)
    retry_rate: Decimal = Decimal(0)
    task_success_rate: Decimal = Decimal(1)
    cards: tuple[str, ...] | None = None  # None: every card given to `estimate_all`
    self_hosted: MachineBasis | None = None
    name: str = "workload"

    def __post_init__(self) -> None:
        for field in ("cache_hit_rate", "cache_write_rate", "batch_share", "retry_rate"):
            if not 0 <= getattr(self, field) <= 1:
                raise WorkloadError(f"workload: '{field}' must be in [0, 1], got {getattr(self, field)}")
        if not 0 < self.task_success_rate <= 1:
            raise WorkloadError(f"workload: 'task_success_rate' must be in (0, 1], got {self.task_success_rate}")
        if self.cache_hit_rate + self.cache_write_rate > 1:
            raise WorkloadError("workload: 'cache_hit_rate' + 'cache_write_rate' must be <= 1")
        if self.requests_per_month <= 0:
            raise WorkloadError(f"workload: 'requests_per_month' must be > 0, got {self.requests_per_month}")


@dataclass(frozen=True)
class Estimate:
    """One card's monthly bill for a workload; USD unless named otherwise."""

    card: str
    monthly_usd: Decimal
    usd_per_success: Decimal
    input_usd: Decimal  # monthly, all input-side parts (plain, cached, cache write)
    output_usd: Decimal  # monthly
    input_tokens: Decimal  # monthly, retries included
    output_tokens: Decimal
    long_context_share: Decimal | None  # share of requests above the card's threshold; None: no rule
    batch_at_list: bool  # the workload has a batch share but the (provider) card no batch price

    @property
    def usd_per_mtok_input(self) -> Decimal:
        """Effective USD per 1M input tokens for this workload (cache, batch, long context in)."""
        return self.input_usd / self.input_tokens * MILLION if self.input_tokens else Decimal(0)

    @property
    def usd_per_mtok_output(self) -> Decimal:
        return self.output_usd / self.output_tokens * MILLION if self.output_tokens else Decimal(0)


def _expected_parts(card: RateCard, w: Workload, batch: bool) -> tuple[Decimal, Decimal, Decimal]:
    """(E[input-side USD], E[output USD], P(long context)) for one request of one kind."""
    mean_in, mean_out = w.input_tokens.mean(), w.output_tokens.mean()
    if card.long_context is None:
        p_long, in_long = Decimal(0), Decimal(0)
    else:
        p_long, in_long = w.input_tokens.tail(card.long_context.threshold_tokens)
    plain_share = 1 - w.cache_hit_rate - w.cache_write_rate
    input_usd = output_usd = Decimal(0)
    for long_context, p, tokens_in in ((False, 1 - p_long, mean_in - in_long), (True, p_long, in_long)):
        if p == 0 and tokens_in == 0:
            continue  # also skips asking a card without the rule for long-context rates
        r = rates(card, batch=batch, long_context=long_context)
        input_usd += tokens_in * (plain_share * r.input + w.cache_hit_rate * r.cached_input
                                  + w.cache_write_rate * r.cache_write)
        output_usd += mean_out * p * r.output
    return input_usd, output_usd, p_long


def estimate(card: RateCard, w: Workload) -> Estimate:
    """Expected monthly cost of workload `w` under `card` (method in the module doc)."""
    with localcontext(prec=40):
        in_list, out_list, p_long = _expected_parts(card, w, batch=False)
        in_batch, out_batch, _ = _expected_parts(card, w, batch=True)
        b = w.batch_share
        per_request_in = (1 - b) * in_list + b * in_batch
        per_request_out = (1 - b) * out_list + b * out_batch
        billed = w.requests_per_month * (1 + w.retry_rate)  # requests billed, retries included
        input_usd, output_usd = per_request_in * billed, per_request_out * billed
        monthly = input_usd + output_usd
        return Estimate(
            card=card.name, monthly_usd=monthly,
            usd_per_success=monthly / (w.requests_per_month * w.task_success_rate),
            input_usd=input_usd, output_usd=output_usd,
            input_tokens=w.input_tokens.mean() * billed, output_tokens=w.output_tokens.mean() * billed,
            long_context_share=None if card.long_context is None else p_long,
            # a self-hosted batch is the same machine time, not a missing price
            batch_at_list=b > 0 and card.batch is None and card.machine is None)


def workload_cards(w: Workload, cards: dict[str, RateCard]) -> list[RateCard]:
    """The cards a workload asks for (all when it names none), plus its self-hosted card."""
    if w.cards is None:
        chosen = list(cards.values())
    else:
        unknown = [n for n in w.cards if n not in cards]
        if unknown:
            raise WorkloadError(f"workload: unknown card(s) {', '.join(unknown)} "
                                f"(known: {', '.join(sorted(cards))})")
        chosen = [cards[n] for n in w.cards]
    if w.self_hosted is not None:
        m = w.self_hosted
        chosen.append(self_hosted_card(SELF_HOSTED_NAME, m.usd_per_hour, m.input_tokens_per_s,
                                       m.output_tokens_per_s, cached_input_ratio=m.cached_input_ratio,
                                       notes="from the workload's [self_hosted] machine"))
    return chosen


def estimate_all(w: Workload, cards: dict[str, RateCard]) -> list[Estimate]:
    return [estimate(card, w) for card in workload_cards(w, cards)]


def load_workload(path: str | Path) -> Workload:
    """A Workload from a TOML/YAML file; WorkloadError names the bad field."""
    path = Path(path)
    data = read_mapping_file(path, "workload", WorkloadError)
    return parse_workload(data, where=f"workload {path.name}")


def parse_workload(data: dict, where: str = "workload") -> Workload:
    f = Fields(data, where, WorkloadError)
    f.only(_KEYS)
    one = Decimal(1)
    cards = None
    if f.has("cards"):
        raw = f.raw("cards")
        if not isinstance(raw, list) or not raw or not all(isinstance(c, str) for c in raw):
            raise f.fail(f"'cards' must be a non-empty list of card names, got {raw!r}")
        cards = tuple(raw)
    machine = None
    m = f.sub("self_hosted")
    if m is not None:
        m.only(("usd_per_hour", "input_tokens_per_s", "output_tokens_per_s", "cached_input_ratio"))
        machine = MachineBasis(m.number("usd_per_hour"), m.number("input_tokens_per_s", positive=True),
                               m.number("output_tokens_per_s", positive=True),
                               m.number("cached_input_ratio", Decimal(0), max_value=one))
    try:
        return Workload(
            name=f.text("name", "workload"),
            requests_per_month=f.number("requests_per_month", positive=True),
            input_tokens=parse_distribution(f.raw("input_tokens"), where, "input_tokens", WorkloadError),
            output_tokens=parse_distribution(f.raw("output_tokens"), where, "output_tokens", WorkloadError),
            cache_hit_rate=f.number("cache_hit_rate", Decimal(0), max_value=one),
            cache_write_rate=f.number("cache_write_rate", Decimal(0), max_value=one),
            batch_share=f.number("batch_share", Decimal(0), max_value=one),
            retry_rate=f.number("retry_rate", Decimal(0), max_value=one),
            task_success_rate=f.number("task_success_rate", one, max_value=one, positive=True),
            cards=cards, self_hosted=machine)
    except WorkloadError as exc:
        # __post_init__ says "workload:"; prefer the located name when we have one
        raise WorkloadError(str(exc).replace("workload:", f"{where}:", 1)) from None
