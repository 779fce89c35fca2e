"""One engine replica: a Ray Serve deployment holding a tokenmill engine in its actor.

The engine runs in thread mode inside the replica's own process (the replica actor is
already the process boundary; a further child would outlive a killed actor). The
ingress streams a request's outputs from `generate`; cancelling that stream (the
client went away) aborts the request here. `record_routing_stats` is Ray Serve's hook
for what a replica tells the routers: this one sends its engine's counters, which the
ingress sums into cluster-wide stats and per-replica metrics.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engine.api import EngineConfig, RequestOutput
from tokenmill.engine.factory import make_engine


class EngineReplica:
    async def __init__(self, config: EngineConfig, log_format: str = "text") -> None:
        from tokenmill.logs import configure_logging

        configure_logging("info", log_format)
        self._claim = None
        if config.cache.kv_disk_dir:  # one server per directory: each replica takes its own under it
            path, self._claim = claim_subdir(config.cache.kv_disk_dir)
            config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_disk_dir=path))
        self.engine = make_engine(config, "thread")
        await self.engine.start()
        self.requests = 0  # routed here: the ingress shows it per replica

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[RequestOutput]:
        """Outputs of one request. Times are sent as ages, since the ingress's monotonic
        clock need not be this process's (another node's is not)."""
        self.requests += 1
        now = time.monotonic()
        deadline = req.get("deadline_in_s")
        stream = self.engine.generate(req["request_id"], req["prompt_token_ids"], req["params"],
                                      priority=req["priority"], cache_salt=req["cache_salt"], tenant=req["tenant"],
                                      arrival_time=now - req["age_s"],
                                      deadline=None if deadline is None else now + deadline)
        async for out in stream:
            yield rebase_times(out, -time.monotonic())

    def limits(self):
        return self.engine.limits

    def record_routing_stats(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.engine.stats())
        return {"stats": stats, "requests": self.requests, "pid": os.getpid(), "running": self.engine.running}

    def check_health(self) -> None:
        if not self.engine.running or self.engine.gave_up:
            raise RuntimeError(f"the engine is not running: {self.engine.error!r}")

    async def __del__(self) -> None:  # graceful shutdown: Ray drained the requests first
        await self.engine.stop()


def claim_subdir(root: str, limit: int = 1024):
    """The first `replica-N` folder under `root` that no live replica holds, and the open
    file whose lock holds it for this process's life. A replica that restarts takes back
    a folder its predecessor held, with the KV blocks it wrote."""
    for i in range(limit):
        path = os.path.join(root, f"replica-{i}")
        os.makedirs(path, exist_ok=True)
        f = open(os.path.join(path, "claim"), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return path, f
    raise RuntimeError(f"{limit} replicas already hold KV disk folders under {root}")


def rebase_times(out: RequestOutput, shift: float) -> RequestOutput:
    """The output's times moved by `shift` seconds (to ages here, back to the ingress's
    clock there)."""
    t = out.times
    if t is None:
        return out

    def mv(v: float | None) -> float | None:
        return None if v is None else v + shift

    out.times = dataclasses.replace(t, arrival=t.arrival + shift, first_scheduled=mv(t.first_scheduled),
                                    first_token=mv(t.first_token), tokens=[v + shift for v in t.tokens],
                                    finished=mv(t.finished), preempted=[v + shift for v in t.preempted])
    return out
