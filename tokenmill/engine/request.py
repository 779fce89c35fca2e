"""One sequence's state as the scheduler sees it: token ids and counters, no tensors.

A user request with n > 1 becomes n `Request`s (one per sample) sharing a
`group_id`; each moves through the same state machine:

    WAITING -> RUNNING -> FINISHED_*        (PREEMPTED -> back to WAITING, recompute)
"""

from __future__ import annotations

import enum
import secrets
import time

from tokenmill.engine.types import Priority, RequestTimes, ResolvedParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: ResolvedParams,
                 *, group_id: str | None = None, index: int = 0, priority: int = Priority.INTERACTIVE,
                 cache_salt: str | None = None, arrival_time: float | None = None,
                 eos_token_ids: tuple[int, ...] = (), tenant: str | None = None, lora_slot: int = -1):
        self.request_id = request_id
        self.group_id = group_id or request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        # Sampling draws its random numbers from (seed, output position): the client's seed
        # (offset by the choice's index, so n choices differ), else one drawn here.
        self.seed = (params.seed + index) % 2 ** 64 if params.seed is not None else secrets.randbits(64)
        self.priority = int(priority)
        self.tenant = tenant
        # Isolation key of the prefix cache: tenant and the client's own salt.
        self.cache_salt = cache_salt
        self.lora_slot = lora_slot  # its LoRA adapter's slot in the model (-1: the base model)
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.cache_write_tokens: dict[int, int] = {}  # TTL s -> prompt tokens pinned in the cache (written)
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative drafts checked by the model
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_reasoning_tokens = 0  # of the output, inside its thinking block (engine/thinking.py)
        self.stop_reason: int | str | None = None
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.monotonic())
        self.arrival_seq = 0  # set by the scheduler: FCFS order within a priority class
        self.admit_seq = 0  # set each time the request enters the running queue
        self.deadline: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
