"""Per-tenant spend budgets: USD per period, checked before a request, recorded after.

Periods are fixed windows aligned to the clock's zero (with the default wall clock
and `period_s=86400`, UTC days): window `k` covers `[k * period_s, (k+1) * period_s)`
and spend resets when the next window starts. A tenant is admitted while its spend in
the current window is below its limit; once spend reaches the limit, `check` returns
a `BudgetExhausted` carrying the seconds until the window rolls over, which the server
turns into HTTP 429 with `Retry-After`.

Cost is known only after a request finishes, so requests admitted concurrently can
overshoot the limit by what they cost; the next check then refuses. That is the
honest guarantee of an after-the-fact meter: spend stops within one in-flight
request per concurrent slot of the limit.

In-process and thread-safe (one lock); one `Ledger` per server, no globals; the
clock is injected so tests move time by hand.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from tokenmill.cost.values import to_decimal


@dataclass(frozen=True)
class SpendBudget:
    """At most `limit_usd` per `period_s` seconds."""

    limit_usd: Decimal
    period_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "limit_usd", to_decimal(self.limit_usd))
        if not self.limit_usd >= 0:
            raise ValueError(f"budget limit_usd must be >= 0, got {self.limit_usd}")
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"budget period_s must be a positive number of seconds, got {self.period_s}")


@dataclass(frozen=True)
class BudgetExhausted:
    """Why a tenant is refused, and when to come back."""

    tenant: str
    spent_usd: Decimal
    limit_usd: Decimal
    period_s: float
    retry_after_s: float  # seconds until the current window ends

    @property
    def retry_after_header(self) -> str:
        """Whole seconds for an HTTP `Retry-After` header (rounded up, at least 1)."""
        return str(max(1, math.ceil(self.retry_after_s)))

    def message(self) -> str:
        return (f"spend budget exhausted for tenant '{self.tenant}': spent ${self.spent_usd} of "
                f"${self.limit_usd} this {self.period_s:g}s period; retry after {self.retry_after_header}s")


@dataclass
class _Window:
    index: int
    spent: Decimal = field(default_factory=Decimal)


class Ledger:
    """Spend per tenant in the current window of that tenant's budget.

    `budgets` gives per-tenant budgets; `default` applies to every other tenant
    (None: tenants without a budget are never refused, though their spend is kept).
    """

    def __init__(self, budgets: Mapping[str, SpendBudget] | None = None, default: SpendBudget | None = None,
                 clock: Callable[[], float] = time.time):
        self._budgets = dict(budgets or {})
        self._default = default
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def budget_for(self, tenant: str) -> SpendBudget | None:
        return self._budgets.get(tenant, self._default)

    def check(self, tenant: str) -> BudgetExhausted | None:
        """None if `tenant` may spend now, else why not and for how long."""
        budget = self.budget_for(tenant)
        if budget is None:
            return None
        now = self._clock()
        with self._lock:
            spent = self._current(tenant, budget, now).spent
        if spent < budget.limit_usd:
            return None
        window_end = (self._index(budget, now) + 1) * budget.period_s
        return BudgetExhausted(tenant, spent, budget.limit_usd, budget.period_s, max(0.0, window_end - now))

    def record(self, tenant: str, usd: Decimal | float | int | str) -> Decimal:
        """Add `usd` to `tenant`'s current window; returns the window's spend so far."""
        amount = to_decimal(usd)
        if amount < 0:
            raise ValueError(f"cannot record negative spend {amount} for tenant '{tenant}'")
        budget = self.budget_for(tenant)
        now = self._clock()
        with self._lock:
            window = self._current(tenant, budget, now)
            window.spent += amount
            return window.spent

    def spent(self, tenant: str) -> Decimal:
        """`tenant`'s spend in its current window."""
        budget = self.budget_for(tenant)
        now = self._clock()
        with self._lock:
            return self._current(tenant, budget, now).spent

    def remaining(self, tenant: str) -> Decimal | None:
        """USD left this window (never negative), or None for an unlimited tenant."""
        budget = self.budget_for(tenant)
        if budget is None:
            return None
        return max(Decimal(0), budget.limit_usd - self.spent(tenant))

    @staticmethod
    def _index(budget: SpendBudget | None, now: float) -> int:
        # An unlimited tenant keeps one running total (window 0).
        return 0 if budget is None else math.floor(now / budget.period_s)

    def _current(self, tenant: str, budget: SpendBudget | None, now: float) -> _Window:
        """The tenant's window for `now`, started afresh when the period rolled over.

        Caller holds the lock. Only the current window is kept, so memory is one entry
        per tenant however long the server runs.
        """
        index = self._index(budget, now)
        window = self._windows.get(tenant)
        if window is None or window.index != index:
            window = self._windows[tenant] = _Window(index)
        return window
