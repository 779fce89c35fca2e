"""The engine core in a child process, behind the same front as the threaded engine.

The child owns the model, the KV cache and the step loop; this process keeps only
the tokenizer and model metadata. Commands go down one queue; each step's outputs
and a stats snapshot come back up another as one message. `time.monotonic` is
system-wide on Linux, so arrival times and deadlines mean the same on both sides.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import (AbortCommand, AddCommand, EngineDeadError, EngineFront,
                                           run_commands)
from tokenmill.model.loader import load_metadata

log = logging.getLogger("tokenmill.engine")
_STOP = "stop"


def _child_main(config: EngineConfig, cmd_q: Any, out_q: Any) -> None:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.model.loader import load_model

    try:
        m = config.model
        engine = LLMEngine(load_model(m.path, m.dtype, m.quantization), config)
    except BaseException as exc:
        out_q.put(("failed", repr(exc)))
        return
    out_q.put(("ready", engine.limits, engine.stats()))
    try:
        while True:
            cmds = []
            if not engine.has_unfinished():
                cmds.append(cmd_q.get())  # idle: block until there is something to do
            while True:
                try:
                    cmds.append(cmd_q.get_nowait())
                except queue.Empty:
                    break
            if _STOP in cmds:
                break
            aborted, refused = run_commands(engine, cmds)
            outputs = aborted + engine.step()
            if outputs or refused or cmds:
                out_q.put(("step", outputs, [(rid, str(exc)) for rid, exc in refused], engine.stats()))
    except BaseException as exc:
        out_q.put(("failed", repr(exc)))


class ProcessEngine(EngineFront):
    def __init__(self, config: EngineConfig):
        model_config, tokenizer = load_metadata(config.model.path)
        super().__init__(tokenizer, model_config)
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
        self._cmd_q = ctx.Queue()
        self._out_q = ctx.Queue()
        self._proc = ctx.Process(target=_child_main, args=(config, self._cmd_q, self._out_q),
                                 name="tokenmill-engine", daemon=True)
        self._reader: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._proc.is_alive() and self.error is None and self.limits is not None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._proc.start()
        msg = await asyncio.to_thread(self._out_q.get)
        if msg[0] != "ready":
            self.error = RuntimeError(f"engine process failed to start: {msg[1]}")
            raise self.error
        _, self.limits, self._stats = msg
        self._reader = threading.Thread(target=self._read, name="tokenmill-engine-reader", daemon=True)
        self._reader.start()

    async def stop(self) -> None:
        if self._proc.is_alive():
            self._cmd_q.put(_STOP)
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()
        self._out_q.put(None)  # wake the reader
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5)

    def _submit(self, cmd: AddCommand | AbortCommand) -> None:
        self._cmd_q.put(cmd)

    def _read(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            msg = self._out_q.get()
            if msg is None:
                return
            if msg[0] == "failed":
                self.error = EngineDeadError(f"engine process failed: {msg[1]}")
                log.error("%s", self.error)
                loop.call_soon_threadsafe(self._fail_all, self.error)
                return
            _, outputs, refused, stats = msg
            self._stats = stats
            for rid, text in refused:
                loop.call_soon_threadsafe(self._fail, rid, ValueError(text))
            if outputs:
                loop.call_soon_threadsafe(self._deliver, outputs)
