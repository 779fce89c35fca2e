"""Several models in one server: `ModelRouter`, one `EngineClient` over one engine per
model (each its own engine process), loaded on demand within a memory budget.

- A model loads on its first request (or at start with `preload`). Requests for a
  model that is loading wait for it, at most `max_waiting` of them per model (more are
  refused with ModelUnavailable "model_queue_full"); a load that fails answers all of
  them with its error ("model_load_failed") and the next request tries again.
- The memory budget covers the weights and the KV cache of every resident model
  (loaded, loading or unloading). A model's share is estimated before it loads, from
  its files and its KV cache: the model file's size (a GGUF), or the sum of a folder's
  `*.safetensors`, which is what a model stored at its serving precision occupies
  (a file stored wider than it is served, e.g. float32 weights served int4, is
  over-counted; one served wider, e.g. a Q4 GGUF at --dtype float32, under-counted),
  plus the KV cache's `kv_cache_gb`, which the router fixes per model so that the
  engine allocates exactly that (at most). Its real resident size is reported beside
  the estimate (`rss_bytes`, read from the engine process).
- To make room, idle models (no request running or waiting) are unloaded, those whose
  keep_alive has passed first, then the least recently used; a pinned model
  (keep_alive -1) is never unloaded for room. Unloading an idle model before its
  keep_alive ran out, as Ollama does, beats making the request wait minutes for it.
  If every resident model is busy, the load waits until one goes idle; if the pinned
  models alone leave no room, or the model exceeds the budget by itself, the request
  is refused at once ("model_too_large").
- An idle model leaves memory when its keep_alive passes (the latest request's, else
  the router's default): 0 unloads it when its last request ends, infinity pins it.

Loads and unloads run one at a time (an asyncio lock); requests for loaded models
never wait for them. torch-free: the front process imports no torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.engine.api import EngineClient, ModelUnavailable, ServedModel, UnknownModel, check_knobs
from tokenmill.engine.model_memory import GiB, default_budget_bytes, default_kv_cache_gb, rss_bytes, weights_bytes
from tokenmill.engine.types import (EngineDeadError, EngineStats, InvalidParameter, Priority, RequestOutput,
                                    ResolvedParams)

log = logging.getLogger("tokenmill.engine")

AVAILABLE, LOADING, LOADED, UNLOADING = "available", "loading", "loaded", "unloading"
REAP_S = 0.5  # how often idle models are checked against their keep_alive
# EngineStats fields that are gauges of a running engine (the rest are counters, summed
# over every engine ever started so that /metrics' counters never go down on an unload)
_GAUGES = {"num_running", "num_waiting", "num_waiting_interactive", "num_waiting_batch", "oldest_waiting_s",
           "kv_blocks_used", "kv_blocks_total", "kv_pinned_blocks", "kv_disk_used_bytes", "kv_disk_capacity_bytes",
           "kv_disk_files"}


@dataclass
class _Model:
    name: str
    config: EngineConfig
    engine: EngineClient
    weights_bytes: int
    kv_bytes: int
    keep_alive: float
    state: str = AVAILABLE
    leases: int = 0  # requests holding it: waiting for it, resolving, running
    waiting: int = 0  # of those, waiting for it to load
    last_used: float = field(default_factory=time.monotonic)
    load_task: asyncio.Task | None = None
    loads: int = 0
    load_seconds: float | None = None  # the last load's
    error: str | None = None  # the last load's failure
    retired: EngineStats = field(default_factory=EngineStats)  # counters of its engines' earlier runs

    @property
    def estimate(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def expires(self) -> float:
        return self.last_used + self.keep_alive

    @property
    def resident(self) -> bool:
        return self.state != AVAILABLE


class _Lease:
    def __init__(self, router: ModelRouter, model: _Model):
        self._router, self._model, self._held = router, model, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._router._release(self._model)


class ModelRouter:
    """One EngineClient over several models' engines (see the module's docstring).
    `make(config, launch_early)` builds a model's engine client: metadata and tokenizer
    now, weights when it starts."""

    def __init__(self, configs: list[EngineConfig], make: Callable[[EngineConfig, bool], EngineClient], *,
                 budget_bytes: int | None = None, keep_alive: float = 300.0, max_waiting: int = 64,
                 preload: bool = False):
        if not configs:
            raise ValueError("no models to serve")
        if keep_alive < 0:
            keep_alive = math.inf
        self.budget = budget_bytes if budget_bytes is not None else default_budget_bytes()
        self.keep_alive = keep_alive
        self.max_waiting = max_waiting
        self.preload = preload
        kv_default = None
        self._models: dict[str, _Model] = {}
        preloading = 0  # bytes of the models preloaded so far: only those that fit start loading now
        for cfg in configs:
            if cfg.cache.kv_cache_gb is None and cfg.cache.num_blocks is None:
                kv_default = kv_default or default_kv_cache_gb()
                cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_gb=kv_default))
            path = cfg.model.path
            if path is None:
                from tokenmill.model.embedded import default_model_path

                path = default_model_path()
            weights = weights_bytes(path)
            kv = int(cfg.cache.kv_cache_gb * GiB) if cfg.cache.kv_cache_gb else 0
            early = preload and preloading + weights + kv <= self.budget
            preloading += (weights + kv) if early else 0
            engine = make(cfg, early)
            name = engine.model_names()[0]
            if name in self._models:
                raise ValueError(f"two models are named {name!r}; give each a different name")
            self._models[name] = _Model(name, cfg, engine, weights, kv, keep_alive)
        self.bounds = configs[0].bounds
        self.error: BaseException | None = None  # a model's failure is its own: the server stays up
        self.gave_up = False
        self.on_give_up: Callable[[], None] | None = None
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()  # a model went idle or left memory
        self._requests: dict[str, EngineClient] = {}  # request id -> the engine running it
        self._tuned: dict[str, int] = {}
        self._started = False
        self._reaper: asyncio.Task | None = None

    # -- the client seam ----------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._started

    def model_names(self) -> list[str]:
        return list(self._models)

    def _model(self, name: str | None) -> _Model:
        if name is None:
            return next(iter(self._models.values()))
        m = self._models.get(name)
        if m is None:
            raise UnknownModel(name, self.model_names())
        return m

    def served(self, model: str | None = None) -> ServedModel:
        return self._model(model).engine.served()

    async def start(self) -> None:
        self._started = True
        self._reaper = asyncio.ensure_future(self._reap())
        if not self.preload:
            return
        for m in self._models.values():  # in order, while they fit beside the ones before
            used = sum(o.estimate for o in self._models.values() if o.resident)
            if used + m.estimate > self.budget:
                log.warning("not preloading %s: %.2f GiB would exceed the memory budget (%.2f of %.2f GiB in use)",
                            m.name, m.estimate / GiB, used / GiB, self.budget / GiB)
                continue
            try:
                await self.load(m.name)
            except ModelUnavailable as exc:
                log.error("%s", exc)

    async def stop(self) -> None:
        self._started = False
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(m.engine.stop() for m in self._models.values() if m.resident),
                             return_exceptions=True)
        for m in self._models.values():
            m.state = AVAILABLE

    def generate(self, request_id: str, prompt_token_ids: list[int], params: ResolvedParams, *,
                 model: str | None = None, priority: int = Priority.INTERACTIVE, cache_salt: str | None = None,
                 tenant: str | None = None, arrival_time: float | None = None, deadline: float | None = None
                 ) -> AsyncIterator[RequestOutput]:
        m = self._model(model)
        if not self._started:
            raise EngineDeadError("the server is not running")
        kwargs = dict(priority=priority, cache_salt=cache_salt, tenant=tenant, arrival_time=arrival_time,
                      deadline=deadline)
        return self._stream(m, request_id, prompt_token_ids, params, kwargs)

    async def _stream(self, m: _Model, request_id: str, ids: list[int], params: ResolvedParams,
                      kwargs: dict) -> AsyncIterator[RequestOutput]:
        lease = await self._hold(m, None)  # the caller's lease usually holds it already
        self._requests[request_id] = m.engine
        try:
            async for out in m.engine.generate(request_id, ids, params, **kwargs):
                yield out
        finally:
            self._requests.pop(request_id, None)
            lease.release()

    def abort(self, request_id: str) -> None:
        engine = self._requests.get(request_id)
        if engine is not None:
            engine.abort(request_id)

    def abort_all(self) -> None:
        for m in self._models.values():
            if m.state == LOADED:
                m.engine.abort_all()

    def stats(self) -> EngineStats:
        total = EngineStats()
        for m in self._models.values():
            live = m.engine.stats() if m.state == LOADED else EngineStats()
            for f in dataclasses.fields(EngineStats):
                v = getattr(live, f.name) + (0 if f.name in _GAUGES else getattr(m.retired, f.name))
                setattr(total, f.name, max(getattr(total, f.name), v) if f.name == "oldest_waiting_s"
                        else getattr(total, f.name) + v)
        return total

    def replica_stats(self) -> dict[str, dict] | None:
        return None

    def tune(self, **knobs: int) -> None:
        self._tuned.update(check_knobs(knobs))
        for m in self._models.values():
            if m.state == LOADED:
                m.engine.tune(**knobs)

    async def load_adapter(self, name: str, path: str) -> dict:
        # an adapter belongs to one base model's engine, which may be unloaded and restarted
        # at any time here: not built (the routes answered 500 for want of these methods)
        raise InvalidParameter("lora_name", "LoRA adapters are served by `tokenmill serve` with one model, not "
                                            "beside several models")

    async def unload_adapter(self, name: str) -> None:
        raise UnknownModel(name, self.model_names())

    # -- loading and unloading ----------------------------------------------------------
    async def acquire(self, model: str | None, keep_alive: float | None = None) -> _Lease:
        m = self._model(model)
        return await self._hold(m, self.keep_alive if keep_alive is None else keep_alive)

    async def _hold(self, m: _Model, keep_alive: float | None) -> _Lease:
        if not self._started:
            raise EngineDeadError("the server is not running")
        if keep_alive is not None:
            m.keep_alive = math.inf if keep_alive < 0 else keep_alive
        m.leases += 1
        lease = _Lease(self, m)
        if m.state == LOADED:
            return lease
        if m.waiting >= self.max_waiting:
            lease.release()
            raise ModelUnavailable(f"{self.max_waiting} requests already wait for the model {m.name!r} to load; "
                                   "try again shortly", "model_queue_full", retry_after=1.0)
        m.waiting += 1
        try:
            if m.load_task is None:
                m.load_task = asyncio.ensure_future(self._load(m))
            # shielded: a waiter that goes away (client gone) does not cancel the others' load
            await asyncio.shield(m.load_task)
        except BaseException:
            lease.release()
            raise
        finally:
            m.waiting -= 1
        return lease

    def _release(self, m: _Model) -> None:
        m.leases -= 1
        if m.leases:
            return
        m.last_used = time.monotonic()
        self._changed.set()
        if m.keep_alive == 0 and m.state == LOADED:
            asyncio.ensure_future(self._unload_idle(m))

    async def load(self, model: str, keep_alive: float | None = None) -> None:
        (await self.acquire(model, keep_alive)).release()

    async def unload(self, model: str) -> None:
        m = self._model(model)
        m.keep_alive = 0.0  # the next request sets its own again
        await self._unload_idle(m)

    async def _load(self, m: _Model) -> None:
        try:
            async with self._lock:
                if m.state == LOADED:
                    return
                m.state = LOADING
                try:
                    await self._make_room(m)
                    t0 = time.monotonic()
                    m.engine.error, m.engine.gave_up = None, False
                    m.engine.on_give_up = lambda: asyncio.ensure_future(self._gave_up(m))
                    await m.engine.start()
                except ModelUnavailable as exc:
                    m.state, m.error = AVAILABLE, str(exc)
                    raise
                except Exception as exc:
                    m.state = AVAILABLE
                    m.error = f"the model {m.name!r} failed to load: {exc}"
                    log.error("%s", m.error)
                    await self._stop_engine(m)
                    raise ModelUnavailable(m.error, "model_load_failed") from None
                m.state, m.error = LOADED, None
                m.loads += 1
                m.load_seconds = time.monotonic() - t0
                m.last_used = time.monotonic()
                if self._tuned:
                    m.engine.tune(**self._tuned)
                log.info("loaded %s in %.2fs (%.2f GiB estimated)", m.name, m.load_seconds, m.estimate / GiB)
        finally:
            m.load_task = None

    async def _make_room(self, m: _Model) -> None:
        if m.estimate > self.budget:
            raise ModelUnavailable(f"the model {m.name!r} needs about {m.estimate / GiB:.2f} GiB (weights and KV "
                                   f"cache), more than the whole memory budget of {self.budget / GiB:.2f} GiB",
                                   "model_too_large")
        while True:
            others = [o for o in self._models.values() if o is not m and o.resident]
            if sum(o.estimate for o in others) + m.estimate <= self.budget:
                return
            now = time.monotonic()
            idle = [o for o in others if o.state == LOADED and o.leases == 0 and o.keep_alive != math.inf]
            if idle:
                victim = min(idle, key=lambda o: (o.expires > now, o.last_used))
                log.info("unloading %s to make room for %s", victim.name, m.name)
                await self._unload(victim)
                continue
            pinned = sum(o.estimate for o in others if o.keep_alive == math.inf)
            if pinned + m.estimate > self.budget:
                raise ModelUnavailable(
                    f"the model {m.name!r} needs about {m.estimate / GiB:.2f} GiB, and pinned models (keep_alive "
                    f"-1) hold {pinned / GiB:.2f} of the {self.budget / GiB:.2f} GiB memory budget; unload one "
                    "(POST /v1/models/{id}/unload)", "model_too_large")
            self._changed.clear()  # every resident model is busy: wait until one goes idle
            await self._changed.wait()

    async def _unload_idle(self, m: _Model) -> None:
        async with self._lock:
            if m.state == LOADED and m.leases == 0:
                await self._unload(m)

    async def _unload(self, m: _Model) -> None:
        """Under the lock, with no request holding it."""
        final = m.engine.stats()  # idle: its counters are final (kept before it leaves, so none dips)
        for f in dataclasses.fields(EngineStats):
            if f.name not in _GAUGES:
                setattr(m.retired, f.name, getattr(m.retired, f.name) + getattr(final, f.name))
        m.state = UNLOADING
        await self._stop_engine(m)
        m.state = AVAILABLE
        self._changed.set()
        log.info("unloaded %s", m.name)

    @staticmethod
    async def _stop_engine(m: _Model) -> None:
        try:
            await m.engine.stop()
        except Exception:  # its process is gone either way
            log.exception("stopping the engine of %s", m.name)

    async def _gave_up(self, m: _Model) -> None:
        """The model's engine kept dying: it leaves memory; its next request loads it again."""
        log.error("the engine of %s kept dying; unloading it", m.name)
        m.error = f"the engine of {m.name!r} kept dying"
        async with self._lock:
            if m.state == LOADED:
                await self._unload(m)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_S)
            now = time.monotonic()
            for m in list(self._models.values()):
                if m.state == LOADED and m.leases == 0 and m.expires <= now:
                    await self._unload_idle(m)

    # -- what /v1/models shows ----------------------------------------------------------
    def model_states(self) -> list[dict]:
        now = time.monotonic()
        rows = []
        for m in self._models.values():
            served = m.engine.served()
            if served.started_limits is not None:
                max_len = served.started_limits.max_model_len
            else:  # as the engine will set it
                mpe = served.config.max_position_embeddings
                max_len = min(m.config.max_model_len or mpe, mpe)
            loaded = m.state == LOADED
            rows.append({
                "id": m.name, "state": m.state, "max_model_len": max_len,
                "memory": {"estimate_bytes": m.estimate, "weights_bytes": m.weights_bytes,
                           "kv_cache_bytes": m.kv_bytes,
                           "rss_bytes": rss_bytes(getattr(m.engine, "pid", None)) if loaded else None},
                "keep_alive": -1 if m.keep_alive == math.inf else m.keep_alive,
                "expires_in": (max(0.0, m.expires - now) if loaded and not m.leases and m.keep_alive != math.inf
                               else None),
                "requests": m.leases, "waiting": m.waiting, "loads": m.loads, "load_seconds": m.load_seconds,
                "error": m.error})
        return rows
