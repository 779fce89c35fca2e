"""The ingress's engine: an `EngineClient` whose steps run on Ray Serve replicas.

`tokenmill cluster serve` builds the same server as `tokenmill serve` (build_app: API,
keys, gate, pricing, metrics, traces, Batch API) around this engine instead of a local
one. So the API, auth, headers and limits are the single server's, and every request
crosses one gate: a tenant's rate, token and concurrency limits hold across all
replicas because all traffic passes them in this one process.

What it adds:
- start: starts a local Ray cluster (or joins one, `address`), deploys the replicas
  (a fixed count, or Ray Serve autoscaling between min and max on ongoing requests
  per replica), and waits for them; a first start says what it is doing;
- generate: a request's token ids, params and tenant go to the replica the router
  picks (ray_router.TokenmillRouter); its outputs stream back; an abort (client gone)
  cancels that stream, which aborts the request on the replica; a replica that dies
  ends its requests with EngineDeadError (an error to the client, never a hang), and
  Ray Serve starts a new one;
- stats: the replicas' own counters (sent with Ray Serve's routing-stats reports),
  summed for the cluster and kept per replica for /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.engine.api import EngineConfig, EngineDeadError, EngineStats, InvalidParameter, UnknownModel
from tokenmill.cluster.replica import rebase_times
from tokenmill.engine.front import AbortCommand, AddCommand, EngineFront, TuneCommand, generation_defaults
from tokenmill.logs import say
from tokenmill.model.metadata import load_model_info
from tokenmill.model.snapshot import model_snapshot

log = logging.getLogger("tokenmill.cluster")
APP = "tokenmill"
DEPLOYMENT = "engine"


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int | None = 2  # None: autoscale between min_replicas and max_replicas
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing: float = 8.0  # autoscaling target: requests in flight per replica
    scale_down_delay_s: float = 30.0  # autoscaling: load must stay low this long before a replica goes
    routing: str = "affinity"
    imbalance: int = 4  # the load guard: requests a preferred replica may be above the least busy
    address: str | None = None  # an existing Ray cluster; None starts a local one
    max_ongoing: int = 512  # requests Ray Serve sends one replica before it queues them
    stats_period_s: float = 0.5
    drain_s: float = 30.0  # scale-down and shutdown: in-flight requests finish first
    log_format: str = "text"


def stats_sum(reports: list[EngineStats]) -> EngineStats:
    total = EngineStats()
    for s in reports:
        for f in dataclasses.fields(EngineStats):
            if f.name == "oldest_waiting_s":
                total.oldest_waiting_s = max(total.oldest_waiting_s, s.oldest_waiting_s)
            else:
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    return total


class ClusterEngine(EngineFront):
    def __init__(self, config: EngineConfig, options: ClusterOptions):
        info = load_model_info(config.model.path)
        defaults = generation_defaults(info.generation, config.model)
        super().__init__(info.tokenizer, info.config, config.bounds, config.model.served_name, defaults,
                         model_snapshot(config, info, defaults))
        self.config = config
        self.options = options
        self.app = APP  # the Ray Serve application of its replicas (ClusterModels names one per model)
        self.handle = None
        self._started_ray = False
        self._pumps: dict[str, asyncio.Task] = {}
        self._replicas: dict[str, dict[str, Any]] = {}  # replica id -> its last report
        self._poller: asyncio.Task | None = None
        self._up = False

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._up and self.error is None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._deploy)
            self._limits = await self.handle.limits.remote()
        except BaseException:
            await asyncio.to_thread(self._teardown)  # no Ray processes left behind a failed start
            raise
        self._up = True
        self._poll()
        self._poller = asyncio.ensure_future(self._poll_forever())

    def _deploy(self) -> None:
        # Ray's C++ failure-signal handler takes SIGTERM for a crash: it prints a stack
        # trace and arms a 3 s alarm that aborts the process (SIGABRT) in the middle of the
        # drain. The ingress handles its own signals (tokenmill/server/launch.py), so its
        # process goes without; read when ray is imported. Replicas keep Ray's default.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        import ray
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from tokenmill.cluster.replica import EngineReplica
        from tokenmill.cluster.ray_router import TokenmillRouter

        o = self.options
        root = str(Path(__file__).resolve().parents[2])  # replicas import the tokenmill this process runs
        env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "0"}
        if not ray.is_initialized():
            where = f"joining the Ray cluster at {o.address}" if o.address else "starting a local Ray cluster"
            say(f"cluster: {where}")
            ray.init(address=o.address, namespace="tokenmill", include_dashboard=False,
                     runtime_env={"env_vars": env}, logging_level=logging.WARNING, configure_logging=False)
            self._started_ray = o.address is None
        serve.start(proxy_location="Disabled")
        scaling: dict[str, Any]
        if o.replicas is None:
            scaling = {"autoscaling_config": {"min_replicas": o.min_replicas, "max_replicas": o.max_replicas,
                                              "target_ongoing_requests": o.target_ongoing,
                                              "look_back_period_s": 10.0, "upscale_delay_s": 5.0,
                                              "downscale_delay_s": o.scale_down_delay_s}}
            what = f"{o.min_replicas} to {o.max_replicas} replicas (autoscaling)"
        else:
            scaling = {"num_replicas": o.replicas}
            what = f"{o.replicas} replica{'s' if o.replicas != 1 else ''}"
        say(f"cluster: deploying {what} of {self.name}, {o.routing} routing; each "
            "loads the model (prepared weights come from the on-disk cache when warm)")
        deployment = serve.deployment(EngineReplica, name=DEPLOYMENT).options(
            max_ongoing_requests=o.max_ongoing,
            ray_actor_options={"num_cpus": 0},  # threads are ours to set (config.num_threads)
            request_router_config=RequestRouterConfig(
                request_router_class=TokenmillRouter,
                request_router_kwargs={"policy": o.routing, "block_size": self.config.cache.block_size,
                                       "imbalance": o.imbalance},
                request_routing_stats_period_s=o.stats_period_s,
                request_routing_stats_timeout_s=max(1.0, 4 * o.stats_period_s)),
            health_check_period_s=2.0, health_check_timeout_s=10.0,
            graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=o.drain_s,
            **scaling)
        config = self.config
        if config.cache.kv_disk_dir and self.app != APP:  # one of several models: its KV blocks apart
            config = dataclasses.replace(config, cache=dataclasses.replace(
                config.cache, kv_disk_dir=os.path.join(config.cache.kv_disk_dir, self.app)))
        t0 = time.monotonic()
        serve.run(deployment.bind(config, o.log_format), name=self.app, route_prefix=None, blocking=False)
        self.handle = serve.get_deployment_handle(DEPLOYMENT, app_name=self.app)
        say(f"cluster: replicas ready in {time.monotonic() - t0:.1f} s")

    async def stop(self) -> None:
        self._stopping = True
        self._up = False
        if self._poller is not None:
            self._poller.cancel()
        for task in list(self._pumps.values()):
            task.cancel()
        await asyncio.to_thread(self._teardown)

    def _teardown(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            serve.delete(self.app)
            if self._started_ray:
                serve.shutdown()
        finally:
            if self._started_ray:
                ray.shutdown()

    # -- requests -----------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> dict:
        # every replica would have to load it, and a replica started later too: not built
        raise InvalidParameter("lora_name", "LoRA adapters are served by `tokenmill serve`, not behind "
                                            "`tokenmill cluster serve`")

    async def unload_adapter(self, name: str) -> None:
        raise UnknownModel(name, self.model_names())

    def _submit(self, cmd: AddCommand | AbortCommand | TuneCommand) -> None:
        if isinstance(cmd, AddCommand):
            self._pumps[cmd.request_id] = asyncio.ensure_future(self._pump(cmd))
        elif isinstance(cmd, AbortCommand):
            task = self._pumps.get(cmd.request_id)
            if task is not None:
                task.cancel()

    async def _pump(self, cmd: AddCommand) -> None:
        kw = cmd.kwargs
        now = time.monotonic()
        req = {"request_id": cmd.request_id, "prompt_token_ids": cmd.prompt_token_ids, "params": cmd.params,
               "priority": int(kw["priority"]), "cache_salt": kw["cache_salt"], "tenant": kw["tenant"],
               "age_s": now - kw["arrival_time"],
               "deadline_in_s": None if kw["deadline"] is None else kw["deadline"] - now}
        stream = self.handle.options(stream=True).generate.remote(req)
        try:
            async for out in stream:
                self._deliver([rebase_times(out, time.monotonic())])
        except asyncio.CancelledError:
            stream.cancel()  # Ray Serve cancels the replica's generator: it aborts the request there
            raise
        except Exception as exc:  # the replica died (or refused): this request ends, the service goes on
            log.warning("request %s failed on its replica: %r", cmd.request_id, exc)
            self._fail(cmd.request_id, exc if isinstance(exc, ValueError)
                       else EngineDeadError(f"the replica serving this request failed: {type(exc).__name__}"))
        finally:
            self._pumps.pop(cmd.request_id, None)

    def tune(self, **knobs: int) -> None:
        raise ValueError("knobs cannot be tuned across a cluster yet; tune each replica's options at deploy")

    # -- stats --------------------------------------------------------------------------
    def _routers(self) -> list:
        """This application's routers (another model's application has its own)."""
        from tokenmill.cluster.ray_router import LIVE

        return [r for r in list(LIVE) if r.app_name == self.app]

    def _poll(self) -> None:
        routers = self._routers()
        if not routers:
            return  # Ray builds the handle's router at its first call
        reports: dict[str, dict[str, Any]] = {}
        for router in routers:
            reports.update(router.replica_reports())
        self._replicas = reports
        self._stats = stats_sum([EngineStats(**r["stats"]) for r in reports.values()])

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.stats_period_s)
            try:
                self._poll()
            except Exception:  # a bad report must not end the poller
                log.exception("cluster stats poll failed")

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each live replica's last report: its engine stats, requests served and pid."""
        return {rid: dict(r) for rid, r in sorted(self._replicas.items())}

    def router_decisions(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for router in self._routers():
            for k, v in router.router.decisions.items():
                total[k] = total.get(k, 0) + v
        return total

