"""The admission gate: who is asking, may they, and on what terms.

Two phases around tokenization:
  admit(ctx, ...)          before: request rate, concurrency, spend budget, request
                           class, queue bounds and the deadline estimate
  output_cap, reserve      around the resolution: prompt cap, n cap, output and work
                           caps (the resolution clamps max_tokens, so capped output ends
                           with finish_reason "length"); token rate and work budget
and one settlement when the request ends (`ctx.finish(usage)`): reserved output
tokens not used are given back, spend is recorded.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.cost import Ledger, SpendBudget
from tokenmill.engine.api import EngineStats, Priority, ResolvedParams
from tokenmill.server.errors import APIError
from tokenmill.server.keys import Tenant, TenantLimits
from tokenmill.server.limits import ServerTokens, TokenBucket, format_duration, request_burst, retry_after_header
from tokenmill.server.metrics import Metrics

CLASS_PRIORITY = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting_interactive: int = 256
    max_waiting_batch: int = 4096


class TenantState:
    def __init__(self, tenant: Tenant, clock: Callable[[], float]):
        lim = tenant.limits
        self.tenant = tenant
        self.requests = TokenBucket(lim.rpm, 60.0, clock, burst=request_burst(lim.rpm)) if lim.rpm else None
        self.tokens = TokenBucket(lim.tpm, 60.0, clock) if lim.tpm else None
        self.work = TokenBucket(lim.work_budget_tokens, lim.work_window_s, clock) if lim.work_budget_tokens else None
        self.inflight = 0

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        for name, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                h[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
                h[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
                h[f"x-ratelimit-reset-{name}"] = format_duration(bucket.reset_s)
        return h


@dataclass
class Reservation:
    tokens: int = 0  # reserved in the TPM bucket
    work: int = 0  # reserved in the work budget
    prompt: int = 0


class TenantLedger(Ledger):
    """Spend per tenant against the budget in that tenant's current limits."""

    def __init__(self, budget_for: Callable[[str], SpendBudget | None]):
        super().__init__()
        self._lookup = budget_for

    def budget_for(self, tenant: str) -> SpendBudget | None:
        return self._lookup(tenant)


def merge_limits(own: TenantLimits, defaults: TenantLimits) -> TenantLimits:
    """A tenant's limits, with the server's defaults where the tenant sets none."""
    changes = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(TenantLimits)
               if getattr(own, f.name) is None and getattr(defaults, f.name) is not None}
    return dataclasses.replace(own, **changes) if changes else own


class Gate:
    def __init__(self, defaults: TenantLimits, stats: Callable[[], EngineStats], metrics: Metrics,
                 admission: AdmissionConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 server_tokens: ServerTokens | None = None):
        """`server_tokens`: the server's token capacity and use, reported to keys without
        a TPM limit of their own."""
        self.defaults = defaults
        self.stats = stats
        self.server_tokens = server_tokens
        self.metrics = metrics
        self.admission = admission or AdmissionConfig()
        self.ledger = TenantLedger(self._budget_for)
        self.clock = clock
        self._states: dict[str, TenantState] = {}
        self._lock = threading.Lock()
        self._finish_rate = 0.0  # EWMA of finished requests per second, for wait estimates
        self._last_finish: float | None = None

    def _budget_for(self, name: str) -> SpendBudget | None:
        st = self._states.get(name)
        lim = st.tenant.limits if st is not None else self.defaults
        if lim.spend_budget_usd is None:
            return None
        return SpendBudget(lim.spend_budget_usd, lim.spend_period_s)

    def state(self, tenant: Tenant) -> TenantState:
        with self._lock:
            st = self._states.get(tenant.name)
            if st is None or st.tenant.limits != tenant.limits:  # limits changed in the key store
                st = TenantState(tenant, self.clock)
                self._states[tenant.name] = st
            return st

    def headers_for(self, tenant: Tenant | None) -> dict[str, str]:
        """The x-ratelimit-* headers of a tenant's response: its own limits', and the token
        ones always (the server's capacity where the key has no TPM limit, as providers do)."""
        if tenant is None:
            return {}
        st = self.state(Tenant(tenant.name, merge_limits(tenant.limits, self.defaults)))
        h = st.headers()
        if st.tokens is None and self.server_tokens is not None:
            h.update(self.server_tokens.headers())
        return h

    def headroom(self, tenant: Tenant) -> dict:
        """What the tenant may still use: rate buckets, concurrency, spend (the console)."""
        st = self.state(Tenant(tenant.name, merge_limits(tenant.limits, self.defaults)))
        lim = st.tenant.limits
        out: dict = {"inflight": st.inflight, "max_concurrency": lim.max_concurrency}
        for name, bucket in (("requests_per_minute", st.requests), ("tokens_per_minute", st.tokens),
                             ("work_budget_tokens", st.work)):
            out[name] = None if bucket is None else {"limit": bucket.limit, "remaining": bucket.remaining,
                                                     "reset_s": round(bucket.reset_s, 3)}
        remaining = self.ledger.remaining(tenant.name)
        out["spend"] = {"spent_usd": float(self.ledger.spent(tenant.name)),
                        "budget_usd": lim.spend_budget_usd, "period_s": lim.spend_period_s,
                        "remaining_usd": None if remaining is None else float(remaining)}
        return out

    # -- phase 1 --------------------------------------------------------------------------
    def admit(self, ctx, tenant: Tenant, requested_class: str | None, timeout_s: float | None) -> None:
        tenant = Tenant(tenant.name, merge_limits(tenant.limits, self.defaults))
        lim = tenant.limits
        st = self.state(tenant)
        cls = requested_class or lim.default_class
        if cls not in lim.allowed_classes:
            raise APIError(403, f"request class {cls!r} is not allowed for this key", param="priority")
        ctx.tenant = tenant.name
        ctx.limits = lim
        ctx.priority = CLASS_PRIORITY[cls]
        refusal = self.ledger.check(tenant.name)
        if refusal is not None:
            raise self._429(st, refusal.message(), "spend_budget_exceeded", refusal.retry_after_s)
        if lim.max_concurrency is not None and st.inflight >= lim.max_concurrency:
            raise self._429(st, f"too many concurrent requests (limit {lim.max_concurrency})",
                            "concurrency_limit_exceeded", 1.0)
        self._check_queue(ctx.priority, timeout_s)
        if st.requests is not None:
            wait = st.requests.try_take(1)
            if wait is not None:
                raise self._429(st, f"rate limit reached for requests per minute (limit {lim.rpm})",
                                "rate_limit_exceeded", wait)
        st.inflight += 1
        ctx.finalizers.append(lambda usage: self._release(st))
        if timeout_s is not None:
            ctx.deadline = time.monotonic() + timeout_s

    def admit_batch_line(self, ctx, tenant: Tenant) -> None:
        """A Batch API line: the batch class, the tenant's per-request caps (applied in
        output_cap) and its spend budget, but not its live rate limits, concurrency or
        queue bounds: the batch runner paces its own lines."""
        tenant = Tenant(tenant.name, merge_limits(tenant.limits, self.defaults))
        st = self.state(tenant)
        ctx.tenant = tenant.name
        ctx.limits = tenant.limits
        ctx.priority = Priority.BATCH
        ctx.rate_limited = False
        ctx.gate = self
        refusal = self.ledger.check(tenant.name)
        if refusal is not None:
            raise self._429(st, refusal.message(), "spend_budget_exceeded", refusal.retry_after_s)

    def _check_queue(self, priority: int, timeout_s: float | None) -> None:
        s = self.stats()
        waiting = s.num_waiting_interactive if priority == Priority.INTERACTIVE else s.num_waiting_batch
        cap = (self.admission.max_waiting_interactive if priority == Priority.INTERACTIVE
               else self.admission.max_waiting_batch)
        if waiting >= cap:
            raise APIError(503, f"the server is overloaded ({waiting} requests waiting); retry later",
                           code="overloaded", headers={"Retry-After": "1"})
        if timeout_s is not None and self._finish_rate > 0:
            ahead = s.num_waiting_interactive + (s.num_waiting_batch if priority == Priority.BATCH else 0)
            estimate = ahead / self._finish_rate
            if estimate > timeout_s:
                raise APIError(503, f"estimated queue wait {estimate:.1f}s exceeds the request timeout "
                                    f"{timeout_s:.1f}s", code="deadline_unreachable",
                               headers={"Retry-After": retry_after_header(estimate - timeout_s)})

    # -- phase 2 --------------------------------------------------------------------------
    def output_cap(self, ctx, num_prompt: int, n: int) -> int | None:
        """The tenant's caps on a request of `num_prompt` tokens and n samples, before it is
        resolved: refuses (429) a prompt or n over the key's caps; returns the most output
        tokens a sample may have under its output and work caps (None: uncapped), which
        the resolution applies to max_tokens."""
        lim: TenantLimits = ctx.limits
        st = self._states[ctx.tenant]
        if lim.max_prompt_tokens is not None and num_prompt > lim.max_prompt_tokens:
            self.metrics.cap_hits.labels(cap="prompt").inc()
            raise self._429(st, f"prompt has {num_prompt} tokens; this key allows at most {lim.max_prompt_tokens}",
                            "prompt_cap_exceeded", math.inf, param="messages")
        if lim.max_n is not None and n > lim.max_n:
            raise self._429(st, f"n={n} exceeds this key's limit of {lim.max_n}", "n_limit_exceeded",
                            math.inf, param="n")
        cap = lim.max_output_tokens
        if lim.max_work_tokens is not None:
            room = (lim.max_work_tokens - num_prompt) // max(n, 1)  # (n itself is checked by the resolution)
            if room < 1:
                self.metrics.cap_hits.labels(cap="work").inc()
                raise self._429(st, f"{num_prompt} prompt tokens exceed this key's per-request work cap of "
                                    f"{lim.max_work_tokens} tokens", "work_cap_exceeded", math.inf)
            cap = room if cap is None else min(cap, room)
        return cap

    def reserve(self, ctx, num_prompt: int, params: ResolvedParams, capped: bool = False) -> None:
        """Take the resolved request's tokens (prompt + max_tokens x n) from the tenant's
        token rate and work budget (429 if either is spent); what it does not use is given
        back when it settles. `capped`: the tenant's cap lowered its max_tokens."""
        st = self._states[ctx.tenant]
        lim: TenantLimits = ctx.limits
        if capped:
            self.metrics.cap_hits.labels(cap="output").inc()
        cap = params.max_tokens
        total = num_prompt + cap * params.n
        res = Reservation(prompt=num_prompt)
        if not ctx.rate_limited:
            return
        if st.tokens is not None:
            wait = st.tokens.try_take(total)
            if wait is not None:
                raise self._429(st, f"rate limit reached for tokens per minute (limit {lim.tpm}): this request "
                                    f"needs {total} tokens (prompt + max_tokens x n)", "rate_limit_exceeded", wait)
            res.tokens = total
        if st.work is not None:
            wait = st.work.try_take(total)
            if wait is not None:
                if res.tokens:
                    st.tokens.give_back(res.tokens)
                self.metrics.cap_hits.labels(cap="budget").inc()
                raise self._429(st, f"work budget of {lim.work_budget_tokens} tokens per "
                                    f"{format_duration(lim.work_window_s)} is used up", "work_budget_exceeded", wait)
            res.work = total
        ctx.finalizers.append(lambda usage: self._settle(st, res, usage))

    # -- settlement -----------------------------------------------------------------------
    def _settle(self, st: TenantState, res: Reservation, usage: dict | None) -> None:
        used = res.prompt + (usage or {}).get("completion_tokens", 0)
        if res.tokens and used < res.tokens:
            st.tokens.give_back(res.tokens - used)
        if res.work and used < res.work:
            st.work.give_back(res.work - used)

    def _release(self, st: TenantState) -> None:
        st.inflight -= 1
        now = self.clock()
        if self._last_finish is not None:
            dt = max(now - self._last_finish, 1e-3)
            self._finish_rate = 0.8 * self._finish_rate + 0.2 * (1.0 / dt)
        else:
            self._finish_rate = 0.0
        self._last_finish = now

    def _429(self, st: TenantState, message: str, code: str, retry_after: float,
             param: str | None = None) -> APIError:
        headers = st.headers()
        if math.isfinite(retry_after):
            headers["Retry-After"] = retry_after_header(retry_after)
        return APIError(429, message, code=code, param=param, headers=headers)

