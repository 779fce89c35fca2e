"""A thin async front over the synchronous engine core.

The step loop runs in one background thread and owns the engine outright; callers
talk to it through a command queue (add, abort) and receive outputs through one
asyncio queue per request, fed once per step. A consumer that goes away (stream
closed, task cancelled) aborts its request, which frees its blocks before the next
step. `EngineClient` is the seam a process-based core would implement.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import EngineStats, LLMEngine
from tokenmill.engine.output import RequestOutput
from tokenmill.engine.request import Priority
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.model.loader import LoadedModel

log = logging.getLogger("tokenmill.engine")


class EngineDeadError(RuntimeError):
    """The step loop failed; requests in flight cannot complete."""


class EngineClient(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 **kwargs: Any) -> AsyncIterator[RequestOutput]: ...
    def abort(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
    @property
    def running(self) -> bool: ...


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]


class AsyncEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.engine = LLMEngine(loaded, config)
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self._cmds: deque[_Add | str] = deque()
        self._wake = threading.Condition()
        self._queues: dict[str, asyncio.Queue] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._stats = self.engine.stats()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        return self._stats  # refreshed by the loop after each step: no cross-thread reads

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # -- client side --------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validate before queueing (pure reads): raises InvalidParameter / AdmissionError.
        Returns the resolved max_tokens."""
        params.validate()
        max_tokens = self.engine.resolve_max_tokens(num_prompt_tokens, params)
        self.engine.scheduler.check_admissible(num_prompt_tokens, max_tokens)
        return max_tokens

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *, priority: int = Priority.INTERACTIVE, cache_salt: str | None = None,
                       tenant: str | None = None, arrival_time: float | None = None,
                       deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        if not self.running:
            raise EngineDeadError("the engine is not running")
        self.check_request(len(prompt_token_ids), params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit(_Add(request_id, prompt_token_ids, params,
                          dict(priority=priority, cache_salt=cache_salt, tenant=tenant,
                               arrival_time=arrival_time, deadline=deadline)))
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            self._queues.pop(request_id, None)
            if remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(request_id)

    def abort_all(self) -> None:
        for rid in list(self._queues):
            self.abort(rid)

    def _submit(self, cmd: _Add | str) -> None:
        with self._wake:
            self._cmds.append(cmd)
            self._wake.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(exc)

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        loop = self._loop
        assert loop is not None
        try:
            while True:
                with self._wake:
                    while not self._cmds and not engine.has_unfinished() and not self._stopping:
                        self._wake.wait()
                    if self._stopping:
                        break
                    cmds = list(self._cmds)
                    self._cmds.clear()
                aborted: list[RequestOutput] = []
                for cmd in cmds:
                    if isinstance(cmd, str):
                        aborted.extend(engine.abort(cmd))
                        continue
                    try:
                        engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, **cmd.kwargs)
                    except ValueError as exc:
                        loop.call_soon_threadsafe(self._fail, cmd.request_id, exc)
                outputs = aborted + engine.step()
                self._stats = engine.stats()
                if outputs:
                    loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # a bug in the step path: fail loudly, not silently
            log.exception("engine loop failed")
            self.error = exc
            dead = EngineDeadError(f"engine loop failed: {exc!r}")
            for rid in list(self._queues):
                loop.call_soon_threadsafe(self._fail, rid, dead)
