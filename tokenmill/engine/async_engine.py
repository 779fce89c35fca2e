"""A thin async front over the synchronous engine core.

The step loop owns the engine outright; callers talk to it through commands (add,
abort) and receive outputs through one asyncio queue per request, fed once per step.
A consumer that goes away (stream closed, task cancelled) aborts its request, which
frees its blocks before the next step.

`EngineFront` is the seam: `AsyncEngine` runs the loop in a thread of this process;
`tokenmill.engine.process_engine.ProcessEngine` runs it in a child process. Only
`_submit` and the loop differ.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import EngineStats, LLMEngine
from tokenmill.engine.output import RequestOutput
from tokenmill.engine.request import Priority
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import AdmissionLimits
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import LoadedModel, load_metadata, load_model
from tokenmill.model.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")


class EngineDeadError(RuntimeError):
    """The step loop failed; requests in flight cannot complete."""


@dataclass
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]


@dataclass
class AbortCommand:
    request_id: str


class EngineFront:
    """The asyncio side: per-request queues, generate(), abort(); subclasses run the loop."""

    def __init__(self, tokenizer: Tokenizer | None, model_config: ModelConfig):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.limits: AdmissionLimits | None = None  # known once the engine is built
        self.error: BaseException | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: EngineStats | None = None

    # -- to implement -------------------------------------------------------------------
    def _submit(self, cmd: AddCommand | AbortCommand) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        assert self.limits is not None
        return self.limits.max_model_len

    def stats(self) -> EngineStats:
        assert self._stats is not None
        return self._stats  # a snapshot refreshed by the loop after each step

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validate before queueing: raises InvalidParameter / AdmissionError. Returns the
        resolved max_tokens."""
        assert self.limits is not None
        params.validate()
        max_tokens = self.limits.resolve_max_tokens(num_prompt_tokens, params.max_tokens)
        self.limits.check(num_prompt_tokens, max_tokens)
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
        self._submit(AddCommand(request_id, prompt_token_ids, params,
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
        self._submit(AbortCommand(request_id))

    def abort_all(self) -> None:
        for rid in list(self._queues):
            self.abort(rid)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._queues):
            self._fail(rid, exc)


def run_commands(engine: LLMEngine, cmds: list[AddCommand | AbortCommand]
                 ) -> tuple[list[RequestOutput], list[tuple[str, Exception]]]:
    """Apply queued commands to the engine: (outputs of aborts, refused adds)."""
    outputs: list[RequestOutput] = []
    refused: list[tuple[str, Exception]] = []
    for cmd in cmds:
        if isinstance(cmd, AbortCommand):
            outputs.extend(engine.abort(cmd.request_id))
            continue
        try:
            engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, **cmd.kwargs)
        except ValueError as exc:
            refused.append((cmd.request_id, exc))
    return outputs, refused


class AsyncEngine(EngineFront):
    """The step loop in a background thread of this process.

    Build it with `AsyncEngine.load(config)` so that the model is loaded and every torch
    op runs on the engine thread: once the main thread has run an OpenMP parallel
    region, its idle workers slow every other thread's parallel regions about 2.5x
    (measured; see the server issue note). An already-loaded model can be passed in too.
    """

    def __init__(self, loaded: LoadedModel | None, config: EngineConfig | None = None, *,
                 model_config: ModelConfig | None = None, tokenizer: Tokenizer | None = None):
        if loaded is not None:
            model_config, tokenizer = loaded.config, loaded.tokenizer
        assert model_config is not None
        super().__init__(tokenizer, model_config)
        self.config = config or EngineConfig()
        self.engine: LLMEngine | None = None
        if loaded is not None:
            self._build(loaded)
        self._cmds: deque[AddCommand | AbortCommand] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()

    @classmethod
    def load(cls, config: EngineConfig) -> "AsyncEngine":
        """Metadata now; weights, KV cache and step loop on the engine thread at start()."""
        model_config, tokenizer = load_metadata(config.model.path)
        return cls(None, config, model_config=model_config, tokenizer=tokenizer)

    def _build(self, loaded: LoadedModel) -> None:
        self.engine = LLMEngine(loaded, self.config)
        self.limits = self.engine.limits
        self._stats = self.engine.stats()

    @property
    def running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.error is None
                and self.engine is not None)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait)
        if self.error is not None:
            raise RuntimeError(f"engine failed to start: {self.error}")

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
            if self.engine is None:
                m = self.config.model
                self._build(load_model(m.path, m.dtype, m.quantization))
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
            self.error = exc
            loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop failed: {exc!r}"))
