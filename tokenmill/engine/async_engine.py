"""The step loop in a thread of this process, behind the shared `EngineFront`."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.engine.front import AbortCommand, AddCommand, EngineFront, generation_defaults, run_commands
from tokenmill.model.metadata import ModelInfo, load_model_info
from tokenmill.model.snapshot import model_snapshot

if TYPE_CHECKING:
    from tokenmill.model.loader import LoadedModel

log = logging.getLogger("tokenmill.engine")


class AsyncEngine(EngineFront):
    """The step loop in a background thread of this process.

    Build it with `AsyncEngine.load(config)` so that the model is loaded and every torch
    op runs on the engine thread: once the main thread has run an OpenMP parallel
    region, its idle workers slow every other thread's parallel regions about 2.5x
    (measured; see the server issue note). An already-loaded model can be passed in too.
    """

    def __init__(self, loaded: LoadedModel | None, config: EngineConfig | None = None, *,
                 info: ModelInfo | None = None):
        """`loaded`: a model already in memory (its generation defaults: none), else `info`
        (load_model_info) and the weights loaded at start()."""
        config = config or EngineConfig()
        if loaded is not None:
            info = ModelInfo(loaded.config, loaded.tokenizer, {})
        assert info is not None
        defaults = generation_defaults(info.generation, config.model)
        snapshot = None if loaded is not None else model_snapshot(config, info, defaults)
        super().__init__(info.tokenizer, info.config, config.bounds, config.model.served_name, defaults, snapshot,
                         config.lora.adapters)
        self.config = config
        self.engine = None  # the LLMEngine, built on the engine thread
        self._loaded = loaded
        self._cmds: deque[AddCommand | AbortCommand] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @classmethod
    def load(cls, config: EngineConfig) -> "AsyncEngine":
        """Metadata now; weights, KV cache and step loop on the engine thread at start()."""
        return cls(None, config, info=load_model_info(config.model.path))

    def _build(self) -> None:
        # (torch: in the engine's thread or process only)
        if self._loaded is None:
            from tokenmill.engine.encoder_engine import build_core

            self.engine = build_core(self.config, self.defaults)
        else:
            from tokenmill.engine.llm_engine import LLMEngine

            self.engine = LLMEngine(self._loaded, self.config, self.defaults)
        self._limits = self.engine.limits
        self._stats = self.engine.stats()

    @property
    def running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and self.engine is not None)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        await self._start_thread()

    async def _start_thread(self) -> None:
        self._ready.clear()
        self.engine = None
        self._cmds.clear()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait)
        if self.engine is None:
            raise RuntimeError(f"engine failed to start: {self.error}")

    async def _restart_loop(self) -> None:
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await self._start_thread()

    async def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def _submit(self, cmd: AddCommand | AbortCommand) -> None:
        with self._wake:
            self._cmds.append(cmd)
            self._wake.notify()

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            self._build()
        except BaseException as exc:
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._cmds and not engine.has_unfinished() and not self._stopping:
                        self._wake.wait()
                    if self._stopping:
                        break
                    cmds = list(self._cmds)
                    self._cmds.clear()
                aborted, refused = run_commands(engine, cmds)
                for rid, exc in refused:
                    loop.call_soon_threadsafe(self._fail, rid, exc)
                outputs = aborted + engine.step()
                self._stats = engine.stats()
                if outputs:
                    loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # a bug in the step path: fail loudly, not silently
            log.exception("engine loop failed")
            loop.call_soon_threadsafe(self._on_death, exc)
        finally:
            engine.close()  # a restarted loop builds a new engine on the same disk tier
