"""What the scheduler hands the runner each step: pure data (ints, ids, token lists), no
request objects' internals and no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.types import ResolvedParams


@dataclass
class ScheduledRequest:
    """What the runner needs to compute one request's chunk this step (pure data)."""
    request_id: str
    token_ids: list[int]  # tokens to compute now, at positions start..start+len-1
    start: int
    block_ids: list[int]
    sample: bool  # the chunk ends at the request's last known token: sample the next one
    params: ResolvedParams
    seed: int  # Request.seed
    output_token_ids: list[int]  # so far; for penalties (a reference, not a copy)
    prompt_token_ids: list[int]
    banned_token_ids: list[int]  # stop tokens masked while min_tokens is unmet
    # speculative drafts: token_ids is the last known token and these, checked in one step
    # (the runner's rows start .. start + len(drafts)); the request gets the accepted ones
    # and one token more
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafts_before: int = 0  # a runner's row of a request with drafts: the drafts before it
    forced_token_id: int | None = None  # the one token this row may sample (a thinking tag: engine/thinking.py)
    lora_slot: int = -1  # its LoRA adapter's slot (-1: the base model)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first
    num_scheduled_tokens: int = 0
    # >1: every scheduled request is a plain decode; run this many steps, each step's
    # token the next step's input (the blocks for all of them are allocated)
    num_steps: int = 1
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # since the last step: drop their state
    # structured outputs: the constrained rows that sample, as (request id, drafts before
    # the row), and their allowed-token bitmask (numpy int32 [rows, words], in that order)
    grammar_rows: list[tuple[str, int]] = field(default_factory=list)
    grammar_bitmask: Any = None
