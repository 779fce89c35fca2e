"""n > 1: the samples of one request share its prompt's KV blocks.

The first sample (the leader) prefills the prompt. The others wait until the
leader's prompt is in the cache, then fork its full prompt blocks (a refcount each,
no copy) and compute only the partial last block. If the leader is gone (finished,
preempted and still waiting), siblings proceed on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class GateDecision:
    ready: bool
    fork_from: Request | None = None


class SampleGroups:
    def __init__(self) -> None:
        self._leaders: dict[str, Request] = {}
        self._sizes: dict[str, int] = {}

    def register(self, requests: list[Request]) -> None:
        if len(requests) > 1:
            gid = requests[0].group_id
            self._leaders[gid] = requests[0]
            self._sizes[gid] = len(requests)

    def gate(self, req: Request) -> GateDecision:
        leader = self._leaders.get(req.group_id)
        if leader is None or leader is req:
            return GateDecision(True)
        if leader.status == RequestStatus.RUNNING:
            if leader.num_computed_tokens >= leader.num_prompt_tokens and req.num_computed_tokens == 0:
                return GateDecision(True, fork_from=leader)
            return GateDecision(req.num_computed_tokens > 0)  # leader still prefilling: wait
        if leader.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return GateDecision(False)  # the leader is ahead in the queue; let it go first
        return GateDecision(True)

    def remove(self, req: Request) -> None:
        gid = req.group_id
        if gid in self._sizes:
            self._sizes[gid] -= 1
            if self._sizes[gid] == 0:
                del self._sizes[gid]
                del self._leaders[gid]
