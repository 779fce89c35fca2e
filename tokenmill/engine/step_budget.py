"""One step's budget: the tokens it may compute, the batch class's share of them, and
who has been chosen so far. Choosing a request takes its tokens; preempting one that was
chosen gives them back, in one place, whatever the phase that preempted it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.engine.request import Request
from tokenmill.engine.types import Priority


@dataclass
class StepBudget:
    tokens: int  # left to schedule this step
    batch_tokens: int  # of those, what batch-class requests may still take
    chosen: dict[str, tuple[Request, int]] = field(default_factory=dict)  # id -> (request, tokens now)
    preempted: list[str] = field(default_factory=list)
    per_tenant: dict[str | None, int] | None = None  # running requests per tenant, while admitting

    def __post_init__(self) -> None:
        self._batch_start = self.batch_tokens

    def room(self, req: Request) -> int:
        """The most tokens `req` may be given now."""
        if req.priority == Priority.BATCH:
            return min(self.tokens, self.batch_tokens)
        return self.tokens

    def choose(self, req: Request, num_tokens: int) -> None:
        self.chosen[req.request_id] = (req, num_tokens)
        self.tokens -= num_tokens
        if req.priority == Priority.BATCH:
            self.batch_tokens -= num_tokens

    def extend(self, req: Request, extra: int) -> None:
        """A chosen decode's speculative drafts: rows beside its own (the step's tokens)."""
        _, n = self.chosen[req.request_id]
        self.chosen[req.request_id] = (req, n + extra)
        self.tokens -= extra

    def release(self, req: Request) -> None:
        """`req` was preempted: what it was given goes back to the step."""
        self.preempted.append(req.request_id)
        if self.per_tenant is not None:
            self.per_tenant[req.tenant] -= 1
        given = self.chosen.pop(req.request_id, None)
        if given is not None:
            self.tokens += given[1]
            if req.priority == Priority.BATCH:
                self.batch_tokens += given[1]

    @property
    def batch_spent(self) -> int:
        return self._batch_start - self.batch_tokens

    def tokens_of(self, priority: int) -> int:
        return sum(n for r, n in self.chosen.values() if r.priority == priority)


class BatchShare:
    """Batch work beside interactive work is held to its share (SchedulerConfig.batch_share):
    it spends credit earned by interactive tokens, one token per row or prefill token,
    at most batch_burst_tokens a step. With no interactive work it takes short steps
    (batch_step_tokens), so an interactive request that arrives waits little."""

    def __init__(self) -> None:
        self.credit = 0.0

    def allowance(self, config: SchedulerConfig, live: bool) -> int:
        """The batch class's tokens this step; `live`: interactive work is in the engine."""
        if live:
            return min(int(self.credit), config.batch_burst_tokens)
        self.credit = 0.0  # credit is earned beside live work, not saved up for it
        return min(config.max_num_batched_tokens, config.batch_step_tokens)

    def settle(self, config: SchedulerConfig, live: bool, budget: StepBudget, num_steps: int) -> None:
        if live:
            earned = config.batch_share * budget.tokens_of(Priority.INTERACTIVE) * num_steps
            self.credit = min(self.credit - budget.batch_spent + earned, float(config.batch_burst_tokens))
