"""What requests cost: rate cards, exact per-request pricing, spend budgets, estimates.

The server's seams:
- `load_cards(path | None) -> dict[str, RateCard]`, `find_card(cards, model)`,
  `with_machine(card, usd_per_hour=...)` for the self-hosted `tokenmill-default` card;
- `price(card, input_tokens=..., cached_tokens=..., output_tokens=..., batch=...)
  -> Cost`, whose `to_dict()` is `usage.cost`;
- `Ledger(budgets, default, clock)` with `check(tenant) -> BudgetExhausted | None`
  before a request and `record(tenant, cost.total_usd)` after it;
- `AlarmBoard(clock).observe(scope, SpendAlarm(...), usd) -> AlarmState` for spend-rate
  alarms over a trailing window (per tenant and per server).
Stands beside the engine and server: imports neither.
"""

from tokenmill.cost.alarms import AlarmBoard, AlarmState, SpendAlarm
from tokenmill.cost.budget import BudgetExhausted, Ledger, SpendBudget
from tokenmill.cost.cards import (CardError, LongContext, MachineBasis, Prices, RateCard, find_card, load_cards,
                                  self_hosted_card, with_machine)
from tokenmill.cost.pricing import Cost, PricingError, Rates, price, rates

__all__ = [
    "AlarmBoard", "AlarmState", "BudgetExhausted", "CardError", "Cost", "Ledger", "LongContext", "MachineBasis", "Prices", "PricingError",
    "RateCard", "Rates", "SpendAlarm", "SpendBudget", "find_card", "load_cards", "price", "rates", "self_hosted_card",
    "with_machine",
]
