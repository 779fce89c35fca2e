"""Several models behind one cluster ingress: `ClusterModels`, one `EngineClient` over one
`ClusterEngine` per model.

Each model is its own Ray Serve application (`app_name`: its own deployment, replicas,
autoscaling and router, all with the same options), so replicas of one model never
receive another's requests and prefix-affinity routing stays per model. A request goes
to the engine of the model it names; the ingress's code (build_app: keys, gate, pricing,
traffic control with its rollouts and shadows) is the single server's, as with one model.

Unlike `tokenmill serve --model A --model B` (engine/models.py), nothing is loaded on
demand or unloaded for room: every model's replicas are deployed at start and stay, as
a cluster is sized for what it serves (its memory is the sum of the replicas').
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from tokenmill.cluster.engine import APP, ClusterEngine, stats_sum
from tokenmill.engine.api import (EngineDeadError, EngineStats, InvalidParameter, Priority, RequestOutput,
                                  ResolvedParams, ServedModel, UnknownModel, check_knobs)


def app_name(model: str, taken: set[str]) -> str:
    """`tokenmill-<model>`, in the characters Ray Serve shows plainly in its names and
    logs, made unique against `taken` (two names may differ only in other characters)."""
    base = f"{APP}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', model).strip('-') or 'model'}"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    return name


class ClusterModels:
    """One EngineClient over several models' cluster engines, the first the default."""

    def __init__(self, engines: list[ClusterEngine]):
        if len(engines) < 2:
            raise ValueError("ClusterModels serves several models; one is a ClusterEngine")
        self._engines: dict[str, ClusterEngine] = {}
        for e in engines:
            if e.name in self._engines:
                raise ValueError(f"two models are named {e.name!r}; give each a different name")
            e.app = app_name(e.name, {o.app for o in self._engines.values()})  # (before it deploys)
            self._engines[e.name] = e
        self.bounds = engines[0].bounds
        self.on_give_up = None  # a cluster engine never gives up: Ray Serve replaces dead replicas
        self.gave_up = False
        self._requests: dict[str, ClusterEngine] = {}  # request id -> the engine running it

    @property
    def error(self) -> BaseException | None:
        return next((e.error for e in self._engines.values() if e.error is not None), None)

    @property
    def running(self) -> bool:
        return all(e.running for e in self._engines.values())

    def model_names(self) -> list[str]:
        return list(self._engines)

    def _engine(self, name: str | None) -> ClusterEngine:
        if name is None:
            return next(iter(self._engines.values()))
        e = self._engines.get(name)
        if e is None:
            raise UnknownModel(name, self.model_names())
        return e

    def served(self, model: str | None = None) -> ServedModel:
        return self._engine(model).served()

    async def start(self) -> None:
        # one at a time: the first starts (or joins) Ray and Ray Serve, the rest deploy into it
        started: list[ClusterEngine] = []
        try:
            for e in self._engines.values():
                await e.start()
                started.append(e)
        except BaseException:
            for e in reversed(started):
                await e.stop()
            raise

    async def stop(self) -> None:
        # the reverse order: the engine that started Ray (the first) shuts it down last
        for e in reversed(list(self._engines.values())):
            await e.stop()

    def generate(self, request_id: str, prompt_token_ids: list[int], params: ResolvedParams, *,
                 model: str | None = None, priority: int = Priority.INTERACTIVE, cache_salt: str | None = None,
                 tenant: str | None = None, arrival_time: float | None = None, deadline: float | None = None
                 ) -> AsyncIterator[RequestOutput]:
        e = self._engine(model)
        if not e.running:
            raise EngineDeadError("the server is not running")
        stream = e.generate(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                            tenant=tenant, arrival_time=arrival_time, deadline=deadline)
        return self._track(e, request_id, stream)

    async def _track(self, e: ClusterEngine, request_id: str,
                     stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        self._requests[request_id] = e
        try:
            async for out in stream:
                yield out
        finally:
            self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        e = self._requests.get(request_id)
        if e is not None:
            e.abort(request_id)

    def abort_all(self) -> None:
        for e in self._engines.values():
            e.abort_all()

    def stats(self) -> EngineStats:
        return stats_sum([e.stats() for e in self._engines.values()])

    def replica_stats(self) -> dict[str, dict]:
        """Every model's replicas (Ray's replica ids are unique across applications), each
        row saying which model it holds."""
        rows: dict[str, dict] = {}
        for name, e in self._engines.items():
            for rid, row in e.replica_stats().items():
                rows[rid] = {**row, "model": name}
        return dict(sorted(rows.items()))

    def router_decisions(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for e in self._engines.values():
            for k, v in e.router_decisions().items():
                total[k] = total.get(k, 0) + v
        return total

    def tune(self, **knobs: int) -> None:
        check_knobs(knobs)
        raise ValueError("knobs cannot be tuned across a cluster yet; tune each replica's options at deploy")

    async def load_adapter(self, name: str, path: str) -> dict:
        raise InvalidParameter("lora_name", "LoRA adapters are served by `tokenmill serve` with one model, not "
                                            "behind `tokenmill cluster serve`")

    async def unload_adapter(self, name: str) -> None:
        raise UnknownModel(name, self.model_names())

