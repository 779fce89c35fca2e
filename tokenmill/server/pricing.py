"""Usage priced the way providers price it: `usage.cost` on every response, cost
counters by tenant and model, and spend recorded against tenant budgets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.cost import Cost, Ledger, RateCard, price
from tokenmill.engine.api import Priority, ServedModel, UnknownModel
from tokenmill.server.metrics import Metrics


class Pricer:
    """Prices usage by the card of the model or adapter that answered: its own card
    (`--model-price-card`), else its base model's (an adapter), else the server's."""

    def __init__(self, card: RateCard, model_name: str, metrics: Metrics, ledger: Ledger | None = None,
                 model_cards: dict[str, RateCard] | None = None,
                 served: Callable[[str], ServedModel] | None = None):
        self.card = card
        self.model_name = model_name
        self.metrics = metrics
        self.ledger = ledger
        self.model_cards = model_cards or {}
        self.served = served

    def card_for(self, model: str | None) -> RateCard:
        if model is None or not self.model_cards:
            return self.card
        if model in self.model_cards:
            return self.model_cards[model]
        parent = None
        if self.served is not None:
            try:
                parent = self.served(model).parent
            except UnknownModel:  # (an adapter unloaded since: its base is unknown now)
                parent = None
        return self.model_cards.get(parent, self.card) if parent is not None else self.card

    def cost(self, usage: dict[str, Any], batch: bool, model: str | None = None) -> Cost:
        details = usage.get("prompt_tokens_details", {})
        return price(self.card_for(model), input_tokens=usage["prompt_tokens"],
                     cached_tokens=details.get("cached_tokens", 0),
                     cache_write_tokens=details.get("cache_write_tokens", 0),
                     cache_write_1h_tokens=usage.get("cache_creation", {}).get("ephemeral_1h_input_tokens", 0),
                     output_tokens=usage["completion_tokens"],
                     reasoning_tokens=usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0),
                     batch=batch)

    def attach(self, ctx) -> None:
        """Price the final usage in-band, and record spend however the request ends."""
        batch = ctx.priority == Priority.BATCH
        priced: list[Cost] = []

        def hook(_ctx, usage: dict[str, Any]) -> None:
            c = self.cost(usage, batch, ctx.model)
            priced.append(c)
            usage["cost"] = c.to_dict()

        def record(usage: dict[str, Any] | None) -> None:
            if usage is None:
                return
            c = priced[-1] if priced else self.cost(usage, batch, ctx.model)  # cut short: price what was used
            tenant = ctx.tenant or "anonymous"
            ctx.cost_usd = float(c.total_usd)
            self.metrics.cost.labels(tenant=tenant, model=ctx.model or self.model_name).inc(float(c.total_usd))
            if self.ledger is not None:
                self.ledger.record(tenant, c.total_usd)

        ctx.usage_hooks.append(hook)
        ctx.finalizers.append(record)
