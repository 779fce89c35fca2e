"""The engine's LoRA adapters: which are known (name -> file), which are resident in
the model's slots, and which requests hold them.

A request on an adapter takes its slot when it is added and gives it back when it
ends; an adapter that is known but not resident is read into a slot then, making room
by dropping the least recently used adapter that no request holds. With every slot
held, the request is refused (retryable) rather than queued behind them.

The prefix cache keys a request's blocks by its adapter's file digest too: the same
prompt under two adapters, or under an adapter and the base model, never shares KV.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from tokenmill.config import LoraConfig
from tokenmill.engine.types import EngineBusy, InvalidParameter
from tokenmill.model.lora import Adapter, AdapterSlots, load_adapter

log = logging.getLogger("tokenmill.engine")


@dataclass(frozen=True)
class AdapterInfo:
    """What loading an adapter reports."""
    name: str
    path: str
    rank: int
    modules: tuple[str, ...]
    nbytes: int
    load_seconds: float


class Adapters:
    def __init__(self, model, config: LoraConfig, ops):
        self.config = config
        self.cfg = model.cfg
        self.slots = AdapterSlots(model.cfg, max(1, config.max_loras), ops, model.dtype)
        model.adapters = self.slots
        self.paths: dict[str, str] = {}  # every known adapter
        self.holders: Counter[int] = Counter()  # slot -> requests holding it
        self.last_used: dict[int, float] = {}
        self.held_by: dict[str, int] = {}  # user request id -> slot
        for name, path in config.adapters:
            self.load(name, path)

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read an adapter into a slot now (raises AdapterError for a bad one, having
        changed nothing; EngineBusy when every slot is held)."""
        if name in self.paths:
            raise InvalidParameter("lora_name", f"an adapter named {name!r} is already loaded")
        adapter = load_adapter(name, path, self.cfg, self.config.max_lora_rank)
        self._place(adapter)
        self.paths[name] = path
        log.info("LoRA adapter %s: rank %d, %s, %.1f MiB, loaded in %.2fs", name, adapter.rank,
                 ",".join(adapter.modules), adapter.nbytes / 2 ** 20, adapter.load_seconds)
        return self.info(adapter)

    @staticmethod
    def info(a: Adapter) -> AdapterInfo:
        return AdapterInfo(a.name, a.path, a.rank, tuple(a.modules), a.nbytes, a.load_seconds)

    def unload(self, name: str) -> None:
        if name not in self.paths:
            raise InvalidParameter("lora_name", f"no adapter named {name!r} is loaded")
        slot = self.slots.slot_of(name)
        if slot is not None:
            if self.holders[slot]:
                raise EngineBusy(f"adapter {name!r} has {self.holders[slot]} requests in flight; "
                                     "unload it when they end")
            self.slots.clear(slot)
        del self.paths[name]

    def _place(self, adapter: Adapter) -> int:
        free = [i for i, a in enumerate(self.slots.adapters) if a is None]
        if not free:
            idle = [i for i in range(len(self.slots.adapters)) if not self.holders[i]]
            if not idle:
                raise EngineBusy(f"all {len(self.slots.adapters)} LoRA slots hold adapters with requests "
                                     "in flight (--max-loras); retry")
            free = [min(idle, key=lambda i: self.last_used.get(i, 0.0))]
            log.info("LoRA adapter %s leaves memory for %s", self.slots.adapters[free[0]].name, adapter.name)
            self.slots.clear(free[0])
        self.slots.put(free[0], adapter)
        self.last_used[free[0]] = time.monotonic()
        return free[0]

    def acquire(self, request_id: str, name: str) -> tuple[int, str]:
        """The slot of adapter `name` for a new request (read back in if it left memory),
        held until `release`, and the salt that keys its prefix-cache blocks."""
        if name not in self.paths:
            raise InvalidParameter("model", f"no LoRA adapter named {name!r}")
        slot = self.slots.slot_of(name)
        if slot is None:
            slot = self._place(load_adapter(name, self.paths[name], self.cfg, self.config.max_lora_rank))
        self.holders[slot] += 1
        self.last_used[slot] = time.monotonic()
        self.held_by[request_id] = slot
        return slot, f"lora:{self.slots.adapters[slot].digest}"

    def release(self, request_id: str) -> None:
        slot = self.held_by.pop(request_id, None)
        if slot is not None:
            self.holders[slot] -= 1
            self.last_used[slot] = time.monotonic()

    def listing(self) -> list[dict]:
        resident = {a.name: a for a in self.slots.adapters if a is not None}
        return [dict(name=n, path=p, resident=n in resident,
                     **({"rank": resident[n].rank, "bytes": resident[n].nbytes} if n in resident else {}))
                for n, p in self.paths.items()]
