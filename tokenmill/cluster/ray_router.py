"""Our policies (`routing.Router`) plugged into Ray Serve's request-router extension point.

Ray builds this router inside the process that holds the deployment handle: the
ingress. There it sees every request before a replica does; `LIVE` lets the ingress
read its decisions and the replicas' reported stats.
"""

from __future__ import annotations

import weakref
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tokenmill.cluster.routing import Router

LIVE: "weakref.WeakSet[TokenmillRouter]" = weakref.WeakSet()


class TokenmillRouter(RequestRouter):
    def initialize_state(self, policy: str = "affinity", block_size: int = 16, imbalance: int = 4,
                         **_: Any) -> None:
        self.router = Router(policy, block_size=block_size, imbalance=imbalance)
        self._sent: dict[str, Any] = {}  # internal request id -> replica id
        # Ray may have unpickled this class by value, with globals of its own: register
        # in the module the ingress reads
        from tokenmill.cluster import ray_router

        ray_router.LIVE.add(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        req = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(req, dict):
            choice = self.router.choose(list(by_id), req.get("prompt_token_ids", ()),
                                        (req.get("tenant"), req.get("cache_salt")))
        else:  # a control call (limits): any replica
            choice = self.router.choose(list(by_id))
        # the first rank is ours; should it refuse (its queue is full), Ray tries the rest
        others = [r for rid, r in by_id.items() if rid != choice]
        return [[by_id[choice]], others] if others else [[by_id[choice]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        self._sent[pending_request.metadata.internal_request_id] = replica_id
        self.router.sent(replica_id)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        if self._sent.pop(internal_request_id, None) is not None:
            self.router.done(replica_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.forget(replica_id)

    def replica_reports(self) -> dict[str, dict[str, Any]]:
        """Each live replica's last `record_routing_stats` report, by replica id."""
        return {rid.unique_id: dict(r.routing_stats) for rid, r in self.curr_replicas.items() if r.routing_stats}
