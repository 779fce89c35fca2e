"""The asyncio side of every engine client, torch-free: per-request queues,
check/generate/abort, death and restart. The thread engine (`async_engine.AsyncEngine`),
the process engine (`process_engine.ProcessEngine`) and the cluster engine
(`tokenmill.cluster.engine.ClusterEngine`) subclass `EngineFront` and differ only in
how they start the step loop, submit commands and read its outputs.

The step loop owns the engine outright; callers talk to it through commands (add,
abort) and receive outputs through one asyncio queue per request, fed once per step.
A consumer that goes away (stream closed, task cancelled) aborts its request, which
frees its blocks before the next step.

When the loop dies, every request in flight ends at once with `EngineDeadError`, and
the loop is rebuilt (a fresh engine over the same model) and counted; a loop that
keeps dying gives up, so that a supervisor can restart the whole server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.config import ModelOptions, RequestBounds
from tokenmill.engine.api import RequestLimits, ServedModel, UnknownModel, check_knobs
from tokenmill.engine.types import (EmbeddingSpec, EngineBusy, EngineDeadError, EngineStats, GenerationDefaults,
                                    InvalidParameter, Priority, RequestOutput, ResolvedParams, SamplingParams, Snapshot)

if TYPE_CHECKING:
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")

# A loop that dies this often within the window is not restarted again.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def generation_defaults(model_generation: dict[str, float | int], options: ModelOptions) -> GenerationDefaults:
    """What a silent request gets: the model's generation defaults (or the operator's
    file, or none), then the server's default output cap. Checked here, at start: a bad
    default would otherwise fail every request that relies on it."""
    if options.generation_config == "none":
        model_generation = {}
    elif options.generation_config != "auto":
        from tokenmill.model.generation import read_file

        model_generation = read_file(options.generation_config)
    own = GenerationDefaults(**model_generation)
    try:  # a silent request resolved under them
        RequestLimits(max_model_len=2, cache_tokens=2, vocab_size=1).resolve([[0]], SamplingParams(max_tokens=1),
                                                                             defaults=own)
    except InvalidParameter as exc:
        raise ValueError(f"the generation defaults are out of bounds: {exc}") from None
    if own.max_tokens is not None and own.max_tokens < 1:
        raise ValueError(f"the generation defaults' max_new_tokens must be positive, got {own.max_tokens}")
    return own.over(GenerationDefaults(max_tokens=options.default_max_tokens))


def embedding_spec(cfg: Any) -> EmbeddingSpec:
    """A decoder pools its final hidden states as a request asks (last token by default:
    the one position that has read the whole prompt); an encoder (its EncoderConfig has a
    `pooling`) as it was trained to, and may be truncatable."""
    pooling = getattr(cfg, "pooling", None)
    if pooling is None:
        return EmbeddingSpec(cfg.hidden_size, ("last", "mean"), None, generates=True)
    return EmbeddingSpec(cfg.hidden_size, (pooling,), cfg.truncatable, generates=False)


@dataclass
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: ResolvedParams
    kwargs: dict[str, Any]


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class TuneCommand:
    knobs: dict[str, int]  # checked by api.check_knobs


@dataclass
class AdapterCommand:
    op: str  # load | unload
    name: str
    path: str | None
    reply_id: str | None  # where the answer goes (None: nobody waits, as after a restart)


@dataclass
class AdapterReply:
    """The loop's answer to an AdapterCommand, delivered like a request's output."""
    request_id: str
    info: dict
    finished: bool = True


def refusal(exc: Exception) -> tuple[str, str, str]:
    """A command's refusal as plain data (it crosses a process boundary): kind, param, text."""
    if isinstance(exc, EngineBusy):
        return "busy", "", str(exc)
    return "invalid", getattr(exc, "param", None) or "request_id", str(exc)


def refused_error(kind: str, param: str, text: str) -> Exception:
    return EngineBusy(text) if kind == "busy" else InvalidParameter(param, text)


class EngineFront:
    """The asyncio side: per-request queues, check/generate/abort, death and restart;
    subclasses run the loop."""

    def __init__(self, tokenizer: Tokenizer | None, model_config: ModelConfig, bounds: RequestBounds,
                 name: str | None = None, defaults: GenerationDefaults | None = None,
                 snapshot: Snapshot | None = None, adapters: tuple[tuple[str, str], ...] = ()):
        self.tokenizer = tokenizer
        self.snapshot = snapshot  # what the model's outputs depend on (None: a model built in memory)
        self.model_config = model_config
        self.name = name or model_config.name  # what requests call this model
        self.defaults = defaults or GenerationDefaults()
        self.bounds = bounds  # known before start: the server sizes its body limit by it
        self.error: BaseException | None = None  # set while the loop is dead
        self.gave_up = False  # the loop kept dying: no more restarts
        self.on_give_up: Callable[[], None] | None = None  # the server's exit hook
        self.restarts = 0
        self._restart_times: deque[float] = deque()
        self._limits: RequestLimits | None = None  # known once the engine is built
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: EngineStats = EngineStats()
        self._stopping = False
        self._restarting = False
        self._tuned: dict[str, int] = {}  # knobs changed while serving: a restarted loop gets them too
        # the LoRA adapters requests may name (name -> path); a restarted loop gets them too
        self._adapters: dict[str, str] = dict(adapters)
        self._start_adapters = dict(adapters)  # what a fresh loop loads itself
        for adapter in self._adapters:
            if adapter == self.name:
                raise ValueError(f"the adapter name {adapter!r} is the model's own name")

    # -- to implement -------------------------------------------------------------------
    def _submit(self, cmd: AddCommand | AbortCommand) -> None:
        raise NotImplementedError

    async def _restart_loop(self) -> None:
        """Replace a dead loop by a fresh one (raises if it cannot start)."""
        raise NotImplementedError

    @property
    def running(self) -> bool:
        raise NotImplementedError

    # -- the client seam ----------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        if self._limits is None:
            raise EngineDeadError("the engine has not started")
        return self._limits

    def model_names(self) -> list[str]:
        return [self.name, *self._adapters]

    def served(self, model: str | None = None) -> ServedModel:
        if model is not None and model != self.name:
            if model not in self._adapters:
                raise UnknownModel(model, self.model_names())
            return ServedModel(model, self.tokenizer, self.model_config, self.defaults, self._limits, self.snapshot,
                               parent=self.name, embedding=embedding_spec(self.model_config))
        return ServedModel(self.name, self.tokenizer, self.model_config, self.defaults, self._limits, self.snapshot,
                           embedding=embedding_spec(self.model_config))

    def stats(self) -> EngineStats:
        # a snapshot refreshed by the loop after each step
        return dataclasses.replace(self._stats, engine_restarts=self.restarts)

    def replica_stats(self) -> dict[str, dict] | None:
        return None

    def generate(self, request_id: str, prompt_token_ids: list[int], params: ResolvedParams,
                 *, model: str | None = None, priority: int = Priority.INTERACTIVE,
                 cache_salt: str | None = None, tenant: str | None = None, arrival_time: float | None = None,
                 deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a resolved request (raises EngineDeadError, or UnknownModel for a model
        not served); it is queued when the returned stream is first awaited, so a stream
        never consumed costs nothing."""
        if not self.running:
            raise EngineDeadError("the engine is not running")
        if not isinstance(params, ResolvedParams):
            raise TypeError("generate takes ResolvedParams (ServedModel.resolve)")
        lora = None
        if model is not None and model != self.name:
            if model not in self._adapters:
                raise UnknownModel(model, self.model_names())
            lora = model
        cmd = AddCommand(request_id, list(prompt_token_ids), params,
                         dict(priority=priority, cache_salt=cache_salt, tenant=tenant, lora=lora,
                              arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                              deadline=deadline))
        return self._stream(cmd)

    async def _stream(self, cmd: AddCommand) -> AsyncIterator[RequestOutput]:
        if not self.running:
            raise EngineDeadError("the engine is not running")
        request_id = cmd.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit(cmd)
        remaining = cmd.params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    remaining = 0  # the loop that held it is gone: nothing to abort
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            self._queues.pop(request_id, None)
            if remaining and self.running:
                self.abort(request_id)

    async def load_adapter(self, name: str, path: str) -> dict:
        if name == self.name or name in self._adapters:
            raise InvalidParameter("lora_name", f"the name {name!r} is taken (a model or a loaded adapter)")
        info = await self._ask(AdapterCommand("load", name, path, f"adapter:{uuid.uuid4().hex}"))
        self._adapters[name] = path
        return info

    async def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise UnknownModel(name, self.model_names())
        await self._ask(AdapterCommand("unload", name, None, f"adapter:{uuid.uuid4().hex}"))
        del self._adapters[name]

    async def _ask(self, cmd: AdapterCommand) -> dict:
        """Run a command in the loop and wait for its answer (its refusal raised)."""
        if not self.running:
            raise EngineDeadError("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[cmd.reply_id] = queue
        try:
            self._submit(cmd)
            item = await queue.get()
        finally:
            self._queues.pop(cmd.reply_id, None)
        if isinstance(item, BaseException):
            raise item
        return item.info

    def abort(self, request_id: str) -> None:
        self._submit(AbortCommand(request_id))

    def abort_all(self) -> None:
        for rid in list(self._queues):
            self.abort(rid)

    def tune(self, **knobs: int) -> None:
        knobs = check_knobs(knobs)
        self._tuned.update(knobs)
        if self.running:
            self._submit(TuneCommand(knobs))

    # -- loop side (called on the event loop) -------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(exc)

    def _on_death(self, exc: BaseException) -> None:
        """The loop died: end every request in flight now, then restart the loop."""
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine failed: {exc!r}")
        self.error = error
        for rid in list(self._queues):
            self._fail(rid, error)
        if self._stopping or self._restarting:
            return
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        if len(self._restart_times) >= MAX_RESTARTS:
            self._give_up(f"the engine died {len(self._restart_times) + 1} times within {RESTART_WINDOW_S:.0f}s")
            return
        self._restart_times.append(now)
        self._restarting = True
        asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        log.error("%s; restarting it", self.error)
        try:
            await self._restart_loop()
        except BaseException as exc:
            self._restarting = False
            self._give_up(f"the engine could not be restarted: {exc!r}")
            return
        self._restarting = False
        self.restarts += 1
        self.error = None
        if self._tuned:
            self._submit(TuneCommand(dict(self._tuned)))
        for name in self._start_adapters.keys() - self._adapters.keys():  # unloaded while serving
            self._submit(AdapterCommand("unload", name, None, None))
        for name in self._adapters.keys() - self._start_adapters.keys():  # loaded while serving
            self._submit(AdapterCommand("load", name, self._adapters[name], None))
        log.warning("engine restarted (%d restarts so far)", self.restarts)

    def _give_up(self, why: str) -> None:
        log.critical("%s; giving up", why)
        self.gave_up = True
        if self.on_give_up is not None:
            self.on_give_up()


def run_commands(engine: Any, cmds: list[AddCommand | AbortCommand | TuneCommand | AdapterCommand]
                 ) -> tuple[list[RequestOutput | AdapterReply], list[tuple[str, Exception]]]:
    """Apply queued commands to the engine (an LLMEngine): (outputs of aborts and adapter
    replies, refused commands: InvalidParameter or EngineBusy)."""
    outputs: list[RequestOutput | AdapterReply] = []
    refused: list[tuple[str, Exception]] = []
    for cmd in cmds:
        if isinstance(cmd, AdapterCommand):
            try:
                if cmd.op == "load":
                    info = dataclasses.asdict(engine.load_adapter(cmd.name, cmd.path))
                else:
                    engine.unload_adapter(cmd.name)
                    info = {}
            except (ValueError, EngineBusy) as exc:
                log.warning("LoRA adapter %s: %s", cmd.name, exc)
                if cmd.reply_id is not None:
                    refused.append((cmd.reply_id, refused_error(*refusal(exc))))
                continue
            if cmd.reply_id is not None:
                outputs.append(AdapterReply(cmd.reply_id, info))
            continue
        if isinstance(cmd, AbortCommand):
            outputs.extend(engine.abort(cmd.request_id))
            continue
        if isinstance(cmd, TuneCommand):
            engine.tune(cmd.knobs)
            continue
        try:
            engine.add_resolved(cmd.request_id, cmd.prompt_token_ids, cmd.params, **cmd.kwargs)
        except (ValueError, EngineBusy) as exc:
            refused.append((cmd.request_id, refused_error(*refusal(exc))))
    return outputs, refused


