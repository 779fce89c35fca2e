"""The scheduler: pure Python over ints and request ids; it imports no torch.

One rule, no phases of the engine: every request has `num_computed_tokens` catching up
to its `num_tokens`; each step has one token budget (`StepBudget`). Running requests go
first (decodes, then unfinished prefill chunks), then waiting ones in fair order
(`WaitingQueue`). Chunked prefill, prefix-cache hits and resumption after preemption all
fall out of that rule. When the KV pool runs dry, the lowest-priority, most recently
admitted running request is preempted (its blocks freed, recomputed later).

`schedule()` reads as its phases: running requests, waiting requests, speculative
drafts, decode bursts, the batch share's settlement, the output. The scheduler is the
one owner of request state: `update` applies sampled tokens and token-level stops,
`stop` the stop strings the output processor finds in the text.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from tokenmill.config import SchedulerConfig
from tokenmill.engine.bursts import burst_steps
from tokenmill.engine.parallel import SampleGroups
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenmill.engine.spec import Speculator
from tokenmill.engine.step_budget import BatchShare, StepBudget
from tokenmill.engine.thinking import ThinkingBudgets
from tokenmill.engine.types import Priority
from tokenmill.engine.waiting import WaitingQueue
from tokenmill.kv.manager import KVCacheManager

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput", "TokenConstraints"]


class TokenConstraints(Protocol):
    """What the scheduler asks of a component that constrains what a request may output
    (structured outputs: `tokenmill.engine.structured.GrammarMatchers`)."""

    def accept(self, request_id: str, token: int) -> bool:
        """Advance by a committed token; True: the constraint is complete, stop here."""

    def free(self, request_id: str) -> None:
        """The request ended (stop, length, abort): drop its state."""

    def fill_bitmask(self, request_ids: list[str], ahead: list[list[int]] | None = None,
                     also: list[int | None] | None = None) -> Any:
        """The allowed-token bitmask of each row (numpy int32 [rows, words]); ahead: per
        row, the drafts it comes after; also: per row, a token allowed beside the grammar's."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, constraints: TokenConstraints | None = None):
        self.config = config
        self.kv = kv
        self.constraints = constraints  # advanced with each committed token of a constrained request
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.groups = SampleGroups()
        self.share = BatchShare()
        self.thinking = ThinkingBudgets()
        self._finished_ids: list[str] = []
        self._arrivals = 0
        self._admissions = 0
        self.num_preemptions = 0
        self.spec = (Speculator(config.speculative, config.max_model_len)
                     if config.speculative.enabled else None)

    # -- admission ----------------------------------------------------------------------
    @property
    def cache_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def add_requests(self, reqs: list[Request]) -> None:
        """Add one user request's samples (n of them), resolved against RequestLimits
        (they fit the context and the cache)."""
        for req in reqs:
            assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
            req.arrival_seq = self._arrivals
            self._arrivals += 1
            req.status = RequestStatus.WAITING
            self.requests[req.request_id] = req
            self.waiting.add(req)
        self.groups.register(reqs)
        if reqs[0].params.prompt_logprobs is None:
            self.kv.start_restore(reqs[0])  # a prefix on disk is read back while it waits

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.tick(time.monotonic())  # cache pins whose TTL has passed become evictable
        live = (self.waiting.count(Priority.INTERACTIVE) > 0
                or any(r.priority == Priority.INTERACTIVE for r in self.running))
        budget = StepBudget(self.config.max_num_batched_tokens, self.share.allowance(self.config, live))
        self._schedule_running(budget)
        if not budget.preempted:  # (admitting beside a preemption would only preempt again)
            self._schedule_waiting(budget, time.monotonic())
        drafts = self._plan_drafts(budget)
        num_steps = self._plan_bursts(budget, drafts)
        self.share.settle(self.config, live, budget, num_steps)
        return self._output(budget, drafts, num_steps)

    def _schedule_running(self, budget: StepBudget) -> None:
        """Decodes first, then unfinished prefill chunks (interactive before batch); a
        request the pool cannot grow preempts the newest of the lowest class."""
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        chunks = sorted((r for r in self.running if r.num_tokens - r.num_computed_tokens > 1),
                        key=lambda r: r.priority)
        for req in decodes + chunks:
            if budget.tokens <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(req.num_tokens - req.num_computed_tokens, budget.room(req))
            if num_new <= 0:
                continue  # a batch request past its share: it keeps its blocks and its place
            while self.kv.allocate_slots(req, num_new) is None:
                victim = max(self.running, key=lambda r: (r.priority, r.admit_seq))
                self._take(victim, budget)
                if victim is req:
                    break
            else:
                budget.choose(req, num_new)

    def _schedule_waiting(self, budget: StepBudget, now: float) -> None:
        """Waiting requests in fair order while the budget lasts; a full set of slots or
        pool gives way to a higher class (or a starved tenant) by preemption."""
        budget.per_tenant = {}
        for r in self.running:
            budget.per_tenant[r.tenant] = budget.per_tenant.get(r.tenant, 0) + 1
        for req in self.waiting.iter_fair(budget.per_tenant):
            if budget.tokens <= 0:
                break
            if self.kv.restoring(req):
                continue  # its prefix is being read from disk; others go meanwhile
            if budget.room(req) <= 0:
                break  # a batch request past its share: only batch requests are left
            if len(self.running) >= self.config.max_num_seqs:
                victim = self._slot_victim(req, budget.per_tenant)
                if victim is None:
                    break
                self._take(victim, budget)
            admitted = self._admit(req, budget, now)
            while not admitted and self.groups.gate(req).ready:
                # no blocks for it: a lower class gives up its blocks (recomputed later)
                victim = max((r for r in self.running if r.priority > req.priority),
                             key=lambda r: r.admit_seq, default=None)
                if victim is None:
                    break
                self._take(victim, budget)
                admitted = self._admit(req, budget, now)
            if not admitted:
                if self.groups.gate(req).ready:
                    break  # no room for the head of the queue: don't let others jump it
                continue
            budget.per_tenant[req.tenant] = budget.per_tenant.get(req.tenant, 0) + 1

    def _plan_drafts(self, budget: StepBudget) -> dict[str, list[int]]:
        """Speculative drafts for decodes worth them (their slots allocated here; none
        where the pool cannot hold them)."""
        if self.spec is None or not budget.chosen or budget.tokens <= 0:
            return {}
        decodes = [r for r, n in budget.chosen.values()
                   if r.num_tokens - r.num_computed_tokens == n == 1 and r.params.pooling is None]
        if not decodes:
            return {}
        prefill = sum(n for r, n in budget.chosen.values() if r.num_tokens - r.num_computed_tokens != 1)
        drafts: dict[str, list[int]] = {}
        for rid, d in self.spec.plan(decodes, prefill, budget.tokens).items():
            req = budget.chosen[rid][0]
            d = self._thinking_drafts(req, d)
            if not d:
                continue
            if self.kv.allocate_slots(req, 1 + len(d)) is not None:
                budget.extend(req, len(d))
                drafts[rid] = d
        return drafts

    def _thinking_drafts(self, req: Request, d: list[int]) -> list[int]:
        """Drafts a thinking request may check: a step makes at most its room (no drafts
        past a forced token), and none while a grammar waits for the answer to begin."""
        if req.params.structured is not None and not self.thinking.in_answer(req):
            return []
        room = self.thinking.room(req)
        return d if room is None else d[:room - 1]

    def _plan_bursts(self, budget: StepBudget, drafts: dict[str, list[int]]) -> int:
        """Bursts only when this step admitted and preempted no one and every request
        decodes (a one-token prefill chunk, left by the budget, samples nothing). Requests
        still waiting then wait for a slot, blocks or their group: a burst delays that by
        its length at most."""
        chosen = budget.chosen
        if (self.config.decode_steps > 1 and not budget.preempted and chosen and not drafts
                and all(r.num_tokens - r.num_computed_tokens == 1 and r.params.pooling is None
                        for r, _ in chosen.values())):
            return burst_steps(self.config, self.kv, [r for r, _ in chosen.values()], self.thinking.room)
        return 1

    def _output(self, budget: StepBudget, drafts: dict[str, list[int]], num_steps: int) -> SchedulerOutput:
        """Decodes (with their drafts) first in the flat batch; then prefill chunks. The
        grammar masks of the constrained rows that sample ride along."""
        out = SchedulerOutput(finished_ids=self._finished_ids, num_steps=num_steps, preempted_ids=budget.preempted)
        self._finished_ids = []
        for req, num_new in sorted(budget.chosen.values(),
                                   key=lambda x: x[1] > 1 and x[0].request_id not in drafts):
            start = req.num_computed_tokens
            d = drafts.get(req.request_id, [])
            end = start + num_new - len(d)
            sp = req.params
            sr = ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.token_slice(start, end) + d,
                start=start,
                block_ids=self.kv.blocks_of(req.request_id),
                sample=end == req.num_tokens,
                params=sp,
                seed=req.seed,
                output_token_ids=req.output_token_ids,
                prompt_token_ids=req.prompt_token_ids,
                banned_token_ids=(list(req.eos_token_ids) + list(sp.stop_token_ids)
                                  if req.num_output_tokens < sp.min_tokens else []),
                draft_token_ids=d,
                forced_token_id=self.thinking.forced(req) if end == req.num_tokens else None,
                lora_slot=req.lora_slot,
            )
            out.scheduled.append(sr)
            out.num_scheduled_tokens += num_new
            if (sr.sample and sp.structured is not None and self.constraints is not None
                    and sr.forced_token_id is None and self._grammar_applies(req)):
                out.grammar_rows += [(req.request_id, j) for j in range(len(d) + 1)]
        if out.grammar_rows:
            ahead = None
            if any(j for _, j in out.grammar_rows):
                ahead = [drafts.get(rid, [])[:j] for rid, j in out.grammar_rows]
            # a reply that may still open its thinking block may take the block's first token
            also = [self.requests[rid].params.thinking.open_ids[0] if self.thinking.in_start(self.requests[rid])
                    else None for rid, _ in out.grammar_rows]
            out.grammar_bitmask = self.constraints.fill_bitmask([rid for rid, _ in out.grammar_rows], ahead, also)
        return out

    def _grammar_applies(self, req: Request) -> bool:
        """A grammar constrains the answer after a thinking block; while the reply may still
        open one, the block's opening token is allowed beside the grammar's (fill_bitmask)."""
        return self.thinking.in_answer(req) or self.thinking.in_start(req)

    def _slot_victim(self, req: Request, per_tenant: dict[str | None, int]) -> Request | None:
        """When every sequence slot is taken: a running request that should yield its slot
        to `req`, so batch never blocks interactive and a flooding tenant never starves
        another. The victim is the newest request of the lowest class, from the tenant
        holding the most slots; None if no one should yield."""
        mine = per_tenant.get(req.tenant, 0)

        def yields(r: Request) -> bool:
            if r.priority != req.priority:
                return r.priority > req.priority
            return r.tenant != req.tenant and per_tenant.get(r.tenant, 0) > mine + 1

        candidates = [r for r in self.running if yields(r)]
        if not candidates or not self.groups.gate(req).ready:
            return None
        return max(candidates, key=lambda r: (r.priority, per_tenant.get(r.tenant, 0), r.admit_seq))

    def _admit(self, req: Request, budget: StepBudget, now: float) -> bool:
        gate = self.groups.gate(req)
        if not gate.ready:
            return False
        computed: list[int] = []
        if gate.fork_from is not None:
            n_share = (gate.fork_from.num_prompt_tokens - 1) // self.kv.block_size
            self.kv.fork(gate.fork_from, req, n_share)
            req.num_computed_tokens = n_share * self.kv.block_size
        elif req.num_computed_tokens == 0:
            # (prompt logprobs and a mean pooling read every prompt position's output: no hits)
            computed, _ = self.kv.get_computed_blocks(
                req, use_cache=req.params.prompt_logprobs is None and req.params.pooling is None)
        num_new = min(req.num_tokens - req.num_computed_tokens - len(computed) * self.kv.block_size,
                      budget.room(req))
        if self.kv.allocate_slots(req, num_new, computed) is None:
            if gate.fork_from is not None:
                self.kv.free(req, finished=False)
                req.num_computed_tokens = 0
            return False
        if computed:
            req.num_computed_tokens = len(computed) * self.kv.block_size
        if req.times.first_scheduled is None:
            req.times.first_scheduled = now
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            if gate.fork_from is None and self.kv.enable_caching:
                self.kv.record_query(req.num_tokens, req.num_cached_tokens)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        req.admit_seq = self._admissions
        self._admissions += 1
        self.running.append(req)
        budget.choose(req, num_new)
        return True

    def _take(self, victim: Request, budget: StepBudget) -> None:
        """Preempt `victim` now: its blocks freed, its tokens this step given back."""
        budget.release(victim)
        self._preempt(victim)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req, finished=False)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.times.preempted.append(time.monotonic())
        self.num_preemptions += 1
        self.waiting.add(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed counters, append sampled tokens (one a step), apply token-level
        stops: tokens after a stop are dropped. Returns the requests that produced tokens."""
        now = time.monotonic()
        produced = []
        for sr in out.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            # (of a row with drafts, only the last known token's K/V is surely valid: the
            # accepted drafts' are counted below, as they are appended)
            req.num_computed_tokens += len(sr.token_ids) - len(sr.draft_token_ids)
            if not sr.sample:
                self.kv.cache_blocks(req)
                continue
            if req.params.pooling is not None:  # an embedding: the prompt is computed, nothing is sampled
                self.kv.cache_blocks(req)
                req.times.first_token = now
                produced.append(req)
                self.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                continue
            first = req.times.first_token is None
            if first:
                req.times.first_token = now
            produced.append(req)
            if self.spec is not None:
                self.spec.observe(req, sr.draft_token_ids, sampled[sr.request_id])
            status = None
            for j, tok in enumerate(sampled[sr.request_id]):
                if j:  # a burst or an accepted draft: the row that chose this token wrote the previous one's K/V
                    req.num_computed_tokens += 1
                req.output_token_ids.append(tok)
                req.times.tokens.append(now)
                answer = self.thinking.observe(req, tok)  # (a grammar sees the answer after the thinking)
                if (answer and req.params.structured is not None and self.constraints is not None
                        and self.constraints.accept(req.request_id, tok)):
                    status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
                    break
                status = self._stop_status(req, tok)
                if status is not None:
                    break
            self.kv.cache_blocks(req)
            if first and req.params.cache_pins:  # the prompt is computed: keep what it marked
                req.cache_write_tokens = self.kv.pin_prefix(req, req.params.cache_pins, now)
            if status is not None:
                self.finish(req.request_id, status)
        return produced

    def stop(self, req: Request, num_output_tokens: int, reason: str) -> None:
        """A stop string ends `req`'s text after its first `num_output_tokens` output tokens
        (the output processor found it): the tokens after them, which a burst or accepted
        drafts may have made, are dropped, and the request finishes as stopped."""
        del req.output_token_ids[num_output_tokens:]
        del req.times.tokens[num_output_tokens:]
        self.thinking.replay(req)
        req.stop_reason = reason
        if req.finished:  # ended on a later token (length, EOS): only its reason changes
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.params
        if req.num_output_tokens >= sp.min_tokens:
            if tok in req.eos_token_ids and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- finishing ----------------------------------------------------------------------
    def finish(self, request_id: str, status: RequestStatus, reason: str | None = None) -> Request | None:
        """Finish (stop, length or abort: `reason` says why, e.g. "deadline") a request now
        and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if reason is not None:
            req.stop_reason = reason
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req, finished=True)
        self.groups.remove(req)
        if self.spec is not None:
            self.spec.finished(req, aborted=status == RequestStatus.FINISHED_ABORTED)
        if req.params.structured is not None and self.constraints is not None:
            self.constraints.free(request_id)
        self.thinking.free(request_id)
        req.status = status
        req.times.finished = time.monotonic()
        self._finished_ids.append(request_id)
        return req

    # -- introspection ------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)
