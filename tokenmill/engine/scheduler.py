"""The scheduler: pure Python over ints and request ids; it imports no torch.

One rule, no phases: every request has `num_computed_tokens` catching up to its
`num_tokens`; each step has one token budget. Running requests go first (decodes,
then unfinished prefill chunks), then waiting ones in (priority, arrival) order.
Chunked prefill, prefix-cache hits and resumption after preemption all fall out of
that rule. When the KV pool runs dry, the lowest-priority, most recently admitted
running request is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.config import SchedulerConfig
from tokenmill.engine.types import Priority, SamplingParams
from tokenmill.engine.parallel import SampleGroups
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.spec import Speculator
from tokenmill.kv.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    """What the runner needs to compute one request's chunk this step (pure data)."""
    request_id: str
    token_ids: list[int]  # tokens to compute now, at positions start..start+len-1
    start: int
    block_ids: list[int]
    sample: bool  # the chunk ends at the request's last known token: sample the next one
    params: SamplingParams
    seed: int  # Request.seed
    output_token_ids: list[int]  # so far; for penalties (a reference, not a copy)
    prompt_token_ids: list[int]
    banned_token_ids: list[int]  # stop tokens masked while min_tokens is unmet
    # speculative drafts: token_ids is the last known token and these, checked in one step
    # (the runner's rows start .. start + len(drafts)); the request gets the accepted ones
    # and one token more
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafts_before: int = 0  # a runner's row of a request with drafts: the drafts before it


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first
    num_scheduled_tokens: int = 0
    # >1: every scheduled request is a greedy decode; run this many steps, each step's
    # argmax the next step's input (the blocks for all of them are allocated)
    num_steps: int = 1
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the last step: drop their state


class TokenConstraints(Protocol):
    """What the scheduler asks of a component that constrains what a request may output
    (structured outputs: `tokenmill.engine.structured.GrammarMatchers`)."""

    def accept(self, request_id: str, token: int) -> bool:
        """Advance by a committed token; True: the constraint is complete, stop here."""

    def free(self, request_id: str) -> None:
        """The request ended (stop, length, abort): drop its state."""


class WaitingQueue:
    """Waiting requests: interactive before batch; within a class, tenants take turns
    (the next pick goes to the tenant with the fewest running requests, then the
    earliest arrival), so one tenant's flood cannot starve another; FCFS within a tenant.
    A preempted request returns to its arrival position."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, str | None], list[Request]] = {}
        self._len = 0

    def add(self, req: Request) -> None:
        q = self._queues.setdefault((req.priority, req.tenant), [])
        keys = [r.arrival_seq for r in q]
        q.insert(bisect.bisect(keys, req.arrival_seq), req)
        self._len += 1

    def remove(self, req: Request) -> None:
        key = (req.priority, req.tenant)
        q = self._queues[key]
        q.remove(req)
        if not q:
            del self._queues[key]
        self._len -= 1

    def iter_fair(self, running_per_tenant: dict[str | None, int]):
        """Requests in the order they should be considered for admission (a snapshot)."""
        for prio in sorted({p for p, _ in self._queues}):
            lanes = {t: list(q) for (p, t), q in self._queues.items() if p == prio}
            pos = dict.fromkeys(lanes, 0)
            load = {t: running_per_tenant.get(t, 0) for t in lanes}
            while lanes:
                t = min(lanes, key=lambda x: (load[x], lanes[x][pos[x]].arrival_seq))
                yield lanes[t][pos[t]]
                pos[t] += 1
                load[t] += 1
                if pos[t] == len(lanes[t]):
                    del lanes[t]

    def count(self, priority: int) -> int:
        return sum(len(q) for (p, _), q in self._queues.items() if p == priority)

    def oldest_arrival(self, priority: int) -> float | None:
        """The earliest arrival (monotonic) among waiting requests of a class: each lane is
        in arrival order, so its head is its oldest."""
        heads = [q[0].times.arrival for (p, _), q in self._queues.items() if p == priority and q]
        return min(heads) if heads else None

    def __iter__(self):
        return self.iter_fair({})

    def __len__(self) -> int:
        return self._len


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, constraints: TokenConstraints | None = None):
        self.config = config
        self.kv = kv
        self.constraints = constraints  # advanced with each committed token of a constrained request
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.groups = SampleGroups()
        self._finished_ids: list[str] = []
        self._arrivals = 0
        self._admissions = 0
        self.num_preemptions = 0
        self._batch_credit = 0.0  # batch tokens earned by interactive ones (see schedule)
        self.spec = (Speculator(config.speculative, config.max_model_len)
                     if config.speculative.enabled else None)

    # -- admission ----------------------------------------------------------------------
    @property
    def cache_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    def add_requests(self, reqs: list[Request]) -> None:
        """Add one user request's samples (n of them), already checked by the engine
        against RequestLimits (they fit the context and the cache)."""
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
        now = time.monotonic()
        self.kv.tick(now)
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        chosen: dict[str, tuple[Request, int]] = {}

        # Batch work beside interactive work is held to its share (SchedulerConfig.batch_share):
        # it spends credit earned by interactive tokens, one token per row or prefill token.
        live = (self.waiting.count(Priority.INTERACTIVE) > 0
                or any(r.priority == Priority.INTERACTIVE for r in self.running))
        if live:
            batch_tokens = min(int(self._batch_credit), self.config.batch_burst_tokens)
        else:  # a short step: an interactive request arriving now waits for its end
            self._batch_credit = 0.0  # credit is earned beside live work, not saved up for it
            batch_tokens = min(budget, self.config.batch_step_tokens)
        batch_start = batch_tokens

        # Running requests: decodes first, then unfinished prefill chunks.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        chunks = sorted((r for r in self.running if r.num_tokens - r.num_computed_tokens > 1),
                        key=lambda r: r.priority)  # interactive chunks before batch ones
        for req in decodes + chunks:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.priority == Priority.BATCH:
                if batch_tokens <= 0:
                    continue  # it keeps its blocks and its place; it runs when there is room
                num_new = min(num_new, batch_tokens)
                batch_tokens -= num_new
            while self.kv.allocate_slots(req, num_new) is None:
                victim = max(self.running, key=lambda r: (r.priority, r.admit_seq))
                if victim.request_id in chosen:
                    given = chosen.pop(victim.request_id)[1]
                    budget += given
                    if victim.priority == Priority.BATCH:
                        batch_tokens += given
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                chosen[req.request_id] = (req, num_new)
                budget -= num_new

        # Waiting requests, if nothing had to be preempted to make room this step.
        if not out.preempted_ids:
            per_tenant: dict[str | None, int] = {}
            for r in self.running:
                per_tenant[r.tenant] = per_tenant.get(r.tenant, 0) + 1
            for req in self.waiting.iter_fair(per_tenant):
                if budget <= 0:
                    break
                if self.kv.restoring(req):
                    continue  # its prefix is being read from disk; others go meanwhile
                room = budget
                if req.priority == Priority.BATCH:
                    if batch_tokens <= 0:
                        break  # only batch requests are left in the queue
                    room = min(budget, batch_tokens)
                if len(self.running) >= self.config.max_num_seqs:
                    victim = self._slot_victim(req, per_tenant)
                    if victim is None:
                        break
                    if victim.request_id in chosen:
                        budget += chosen.pop(victim.request_id)[1]
                    self._preempt(victim)
                    per_tenant[victim.tenant] -= 1
                    out.preempted_ids.append(victim.request_id)
                admitted = self._admit(req, room, chosen, now)
                while not admitted and self.groups.gate(req).ready:
                    # no blocks for it: a lower class gives up its blocks (recomputed later)
                    victim = max((r for r in self.running if r.priority > req.priority),
                                 key=lambda r: r.admit_seq, default=None)
                    if victim is None:
                        break
                    if victim.request_id in chosen:
                        given = chosen.pop(victim.request_id)[1]
                        budget += given
                        batch_tokens += given
                        room = budget if req.priority != Priority.BATCH else min(budget, batch_tokens)
                    self._preempt(victim)
                    per_tenant[victim.tenant] -= 1
                    out.preempted_ids.append(victim.request_id)
                    admitted = self._admit(req, room, chosen, now)
                if not admitted:
                    if self.groups.gate(req).ready:
                        break  # no room for the head of the queue: don't let others jump it
                    continue
                if req.priority == Priority.BATCH:
                    batch_tokens -= chosen[req.request_id][1]
                budget -= chosen[req.request_id][1]
                per_tenant[req.tenant] = per_tenant.get(req.tenant, 0) + 1

        # Speculative drafts for decodes worth them (their slots allocated here; none
        # where the pool cannot hold them).
        drafts: dict[str, list[int]] = {}
        if self.spec is not None and chosen and budget > 0:
            decodes = [r for r, n in chosen.values() if r.num_tokens - r.num_computed_tokens == n == 1]
            if decodes:
                prefill = sum(n for r, n in chosen.values() if r.num_tokens - r.num_computed_tokens != 1)
                for rid, d in self.spec.plan(decodes, prefill, budget).items():
                    req = chosen[rid][0]
                    if self.kv.allocate_slots(req, 1 + len(d)) is not None:
                        chosen[rid] = (req, 1 + len(d))
                        budget -= len(d)
                        drafts[rid] = d

        # Bursts only when this step admitted and preempted no one and every request decodes
        # (a one-token prefill chunk, left by the budget, samples nothing). Requests still
        # waiting then wait for a slot, blocks or their group: a burst delays that by its
        # length at most.
        if (self.config.decode_steps > 1 and not out.preempted_ids and chosen and not drafts
                and all(r.num_tokens - r.num_computed_tokens == 1 for r, _ in chosen.values())):
            out.num_steps = self._burst_steps([r for r, _ in chosen.values()])

        if live:
            interactive = sum(n for r, n in chosen.values() if r.priority == Priority.INTERACTIVE)
            self._batch_credit = min(self._batch_credit - (batch_start - batch_tokens)
                                     + self.config.batch_share * interactive * out.num_steps,
                                     float(self.config.batch_burst_tokens))

        # Decodes (with their drafts) first in the flat batch; then prefill chunks.
        for req, num_new in sorted(chosen.values(), key=lambda x: x[1] > 1 and x[0].request_id not in drafts):
            start = req.num_computed_tokens
            d = drafts.get(req.request_id, [])
            end = start + num_new - len(d)
            sp = req.params
            out.scheduled.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.token_slice(start, end) + d,
                start=start,
                block_ids=self.kv.blocks_of(req.request_id),
                sample=end == req.num_tokens,
                params=sp,
                seed=req.seed,
                output_token_ids=req.output_token_ids,
                prompt_token_ids=req.prompt_token_ids,
                banned_token_ids=(list(req.eos_token_ids) + sp.stop_token_ids
                                  if req.num_output_tokens < sp.min_tokens else []),
                draft_token_ids=d,
            ))
            out.num_scheduled_tokens += num_new
        return out

    def _burst_steps(self, reqs: list[Request]) -> int:
        """How many decode steps these decodes (one token each, blocks for it allocated)
        run in one go: decode_steps shared among them, 1 unless each one's next tokens
        depend on nothing but the logits and its seed (greedy or sampled, top-k/top-p/min-p
        included; no logprobs, no penalties, no bias, no grammar, min_tokens met), capped by each one's remaining length; the blocks for the extra steps are
        allocated here (1, allocating nothing, if the pool can't hold them all)."""
        steps = self.config.decode_steps // len(reqs)
        for req in reqs:
            sp = req.params
            if (sp.logprobs is not None or sp.has_penalties
                    or sp.logit_bias or sp.structured is not None or req.num_output_tokens < sp.min_tokens):
                return 1
            steps = min(steps, req.max_tokens - req.num_output_tokens,
                        self.config.max_model_len - req.num_tokens)
        if steps <= 1:
            return 1
        kv = self.kv
        grow = sum(max(0, kv.blocks_needed(r.num_computed_tokens + steps) - len(kv.blocks_of(r.request_id)))
                   for r in reqs)
        if grow > kv.num_free_blocks:
            return 1
        for req in reqs:
            blocks = kv.allocate_slots(req, steps)
            assert blocks is not None  # the room was counted above
        return steps

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

    def _admit(self, req: Request, budget: int, chosen: dict[str, tuple[Request, int]], now: float) -> bool:
        gate = self.groups.gate(req)
        if not gate.ready:
            return False
        computed: list[int] = []
        if gate.fork_from is not None:
            n_share = (gate.fork_from.num_prompt_tokens - 1) // self.kv.block_size
            self.kv.fork(gate.fork_from, req, n_share)
            req.num_computed_tokens = n_share * self.kv.block_size
        elif req.num_computed_tokens == 0:
            computed, _ = self.kv.get_computed_blocks(
                req, use_cache=req.params.prompt_logprobs is None)
        num_new = min(req.num_tokens - req.num_computed_tokens - len(computed) * self.kv.block_size, budget)
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
        chosen[req.request_id] = (req, num_new)
        return True

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
                if (req.params.structured is not None and self.constraints is not None
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

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.params
        if req.num_output_tokens >= sp.min_tokens:
            if tok in req.eos_token_ids and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- finishing ----------------------------------------------------------------------
    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, length or abort) a request now and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
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
