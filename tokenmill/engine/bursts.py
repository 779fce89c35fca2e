"""Decode bursts: several decode steps in one engine step (one native call), when every
request's next tokens depend on nothing but the logits and its seed."""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.config import SchedulerConfig
from tokenmill.engine.request import Request
from tokenmill.kv.manager import KVCacheManager


def burst_steps(config: SchedulerConfig, kv: KVCacheManager, reqs: list[Request],
                room: Callable[[Request], int | None] = lambda req: None) -> int:
    """How many decode steps these decodes (one token each, blocks for it allocated)
    run in one go: decode_steps shared among them, 1 unless each one's next tokens
    depend on nothing but the logits and its seed (greedy or sampled, top-k/top-p/min-p
    included; no logprobs, no penalties, no bias, no grammar, min_tokens met), capped by
    each one's remaining length and its `room` (a thinking budget's tokens before the
    closing tag must be forced: ThinkingBudgets.room); the blocks for the extra steps are allocated here (1,
    allocating nothing, if the pool can't hold them all)."""
    steps = config.decode_steps // len(reqs)
    for req in reqs:
        sp = req.params
        if (sp.logprobs is not None or sp.has_penalties
                or sp.logit_bias or sp.structured is not None or req.num_output_tokens < sp.min_tokens):
            return 1
        steps = min(steps, sp.max_tokens - req.num_output_tokens,
                    config.max_model_len - req.num_tokens)
        bound = room(req)
        if bound is not None:
            steps = min(steps, bound)
    if steps <= 1:
        return 1
    grow = sum(max(0, kv.blocks_needed(r.num_computed_tokens + steps) - len(kv.blocks_of(r.request_id)))
               for r in reqs)
    if grow > kv.num_free_blocks:
        return 1
    for req in reqs:
        blocks = kv.allocate_slots(req, steps)
        assert blocks is not None  # the room was counted above
    return steps
