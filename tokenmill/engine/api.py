"""The engine's public face: the only engine modules the server, the cluster, the Batch
API and the CLI import are this one and its leaf of data types (`engine/types.py`,
re-exported here). It imports no torch.

- `EngineClient`: everything a client of an engine may do and read (start, stop, check,
  generate, abort, stats, tune; tokenizer, limits, generation defaults and context
  window, keyed by the model name a request gives). The thread, process and cluster
  engines implement it over one `EngineFront` (`engine/front.py`); the composition
  module `engine/factory.py` builds one.
- `RequestLimits.check`: every bound a request must meet, checked in one place before
  any work is allocated. A violation raises `InvalidParameter` (or `AdmissionError` for
  the context window) naming the parameter; the server turns both into a 400.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tokenmill.config import (CacheConfig, EngineConfig, ModelOptions, RequestBounds, SchedulerConfig,
                              SpeculativeConfig)
from tokenmill.engine.types import (CACHE_TTLS, GREEDY_BELOW, MAX_CACHE_PINS, POOLINGS, AdmissionError, CachePin,
                                    Choice, EmbeddingSpec, EngineBusy, EngineDeadError, EngineHungError, EngineStats,
                                    GenerationDefaults,
                                    InvalidParameter, Priority, RequestOutput, RequestTimes, ResolvedParams,
                                    SamplingParams, Snapshot, SnapshotMismatch, StructuredOutput, TokenLogprob,
                                    split_snapshot_id, text_digest)

if TYPE_CHECKING:
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.tokenizer import Tokenizer

__all__ = [
    "AdmissionError", "CACHE_TTLS", "CacheConfig", "CachePin", "Choice", "EmbeddingSpec", "EngineBusy",
    "EngineClient", "EngineConfig", "EngineDeadError", "EngineHungError", "EngineStats", "GREEDY_BELOW", "GenerationDefaults",
    "InvalidParameter", "ModelHost", "ModelLease", "ModelOptions", "ModelUnavailable", "POOLINGS", "Priority",
    "RequestBounds", "RequestLimits", "RequestOutput", "RequestTimes", "ResolvedParams", "SamplingParams",
    "SchedulerConfig", "ServedModel", "Snapshot", "SnapshotMismatch", "SpeculativeConfig", "StructuredOutput",
    "TokenLogprob", "TUNABLE", "UnknownModel", "check_knobs", "split_snapshot_id", "text_digest",
]


SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what a torch generator accepts (negatives wrap)
_INT64_MAX = 2 ** 63 - 1
_NO_DEFAULTS = GenerationDefaults()


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one served model: the request caps, its vocabulary, its context
    window and KV cache. Pure data, so a front end in another process can refuse a
    request without asking the engine."""
    max_model_len: int
    cache_tokens: int
    vocab_size: int
    bounds: RequestBounds = field(default_factory=RequestBounds)

    def resolve(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                defaults: GenerationDefaults | None = None, cap: int | None = None) -> ResolvedParams:
        """Check a request (one or more token-id prompts sharing `params`) against every
        bound and resolve it, once, into the parameters the engine runs: `defaults` where
        the client said nothing (then the API's own: temperature 1, no truncation, no
        penalties); max_tokens the client's, else the default for silent requests, else
        the room left in the context; `cap` (a tenant's output cap) clamps it; greedy
        decided, top_k normalized. Raises InvalidParameter / AdmissionError."""
        if params.pooling is not None:
            return self._resolve_pooling(prompts, params)
        d = defaults or _NO_DEFAULTS

        def pick(name: str, api_default):
            v = getattr(params, name)
            if v is None:
                v = getattr(d, name)
            return api_default if v is None else v

        filled = dataclasses.replace(
            params, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0), repetition_penalty=pick("repetition_penalty", 1.0))
        self.check_params(filled)
        b = self.bounds
        if not prompts:
            raise InvalidParameter("prompt", "the prompt is empty")
        if len(prompts) > b.max_prompts:
            raise InvalidParameter("prompt", f"at most {b.max_prompts} prompts per request, got {len(prompts)}")
        longest = 0
        for ids in prompts:
            self.check_token_ids(ids)
            longest = max(longest, len(ids))
        for pin in params.cache_pins:
            if pin.num_tokens > min(len(ids) for ids in prompts):
                raise InvalidParameter("cache_control", f"a cache_control breakpoint at token {pin.num_tokens} "
                                                        "is past the end of the prompt")
        room = self.max_model_len - longest
        max_tokens = params.max_tokens
        if max_tokens is None:
            if room < 1:
                raise AdmissionError(
                    f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                    f"has {longest} tokens", param="messages")
            max_tokens = room if d.max_tokens is None else min(d.max_tokens, room)
        self.check_fits(longest, max_tokens)
        min_tokens = params.min_tokens
        if min_tokens > max_tokens:
            raise InvalidParameter("min_tokens", f"min_tokens ({min_tokens}) must not exceed "
                                                 f"max_tokens ({max_tokens})")
        if cap is not None and cap < max_tokens:
            max_tokens, min_tokens = cap, min(min_tokens, cap)
        greedy = filled.temperature < GREEDY_BELOW  # fp32 logits divided by less overflow
        top_k = filled.top_k
        return ResolvedParams(
            n=params.n, greedy=greedy, temperature=0.0 if greedy else float(filled.temperature),
            top_p=float(filled.top_p), top_k=0 if top_k < 0 else min(top_k, self.vocab_size),
            min_p=float(filled.min_p), presence_penalty=float(filled.presence_penalty),
            frequency_penalty=float(filled.frequency_penalty), repetition_penalty=float(filled.repetition_penalty),
            seed=params.seed, stop=tuple(params.stop), stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=params.ignore_eos, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs, skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logit_bias=dict(params.logit_bias) if params.logit_bias else None, structured=params.structured,
            speculative=params.speculative, cache_pins=tuple(params.cache_pins), thinking=params.thinking,
            thinking_token_budget=params.thinking_token_budget if params.thinking is not None else None)

    def _resolve_pooling(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> ResolvedParams:
        """An embedding request: each prompt computed once, nothing sampled or decoded
        (max_tokens 0), so only the prompts' bounds apply."""
        if params.pooling not in POOLINGS:
            raise InvalidParameter("pooling", f"pooling must be one of {', '.join(POOLINGS)}, got {params.pooling!r}")
        if params.n != 1:
            raise InvalidParameter("n", "an embedding request has one result per input (n must be 1)")
        b = self.bounds
        if not prompts:
            raise InvalidParameter("prompt", "the prompt is empty")
        if len(prompts) > b.max_prompts:
            raise InvalidParameter("prompt", f"at most {b.max_prompts} prompts per request, got {len(prompts)}")
        for ids in prompts:
            self.check_token_ids(ids)
        longest = max(len(ids) for ids in prompts)
        if longest > self.max_model_len:
            raise AdmissionError(f"this model's maximum context length is {self.max_model_len} tokens, but an "
                                 f"input has {longest} tokens", param="input")
        self.check_fits(longest, 0)
        return ResolvedParams(
            n=1, greedy=True, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
            frequency_penalty=0.0, repetition_penalty=1.0, seed=None, stop=(), stop_token_ids=(), ignore_eos=True,
            max_tokens=0, min_tokens=0, logprobs=None, prompt_logprobs=None, skip_special_tokens=True,
            include_stop_str_in_output=False, logit_bias=None, structured=None, speculative=False, cache_pins=(),
            pooling=params.pooling)

    def check_token_ids(self, ids: Sequence[int]) -> None:
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidParameter("prompt", f"prompt token ids must be in [0, {self.vocab_size})")

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise AdmissionError(
                f"this model's maximum context length is {limit} tokens, but {num_prompt_tokens} prompt "
                f"tokens + {max_tokens} max_tokens = {num_prompt_tokens + max_tokens} were requested",
                param="max_tokens")
        if num_prompt_tokens + max_tokens > self.cache_tokens:
            raise AdmissionError(
                f"{num_prompt_tokens} prompt tokens + {max_tokens} max_tokens exceed the whole KV cache "
                f"({self.cache_tokens} tokens); raise the cache size or lower max_tokens", param="max_tokens")

    def check_params(self, p: SamplingParams) -> None:
        b = self.bounds

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParameter(param, message)

        def integer(name: str, lo: int, hi: int) -> None:
            v = getattr(p, name)
            check(isinstance(v, int) and not isinstance(v, bool), name, f"{name} must be an integer")
            check(lo <= v <= hi, name, f"{name} must be between {lo} and {hi}, got {v}")

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(p, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool), name, f"{name} must be a number")
            check(math.isfinite(v), name, f"{name} must be a finite number, got {v}")
            check((lo < v if lo_open else lo <= v) and v <= hi, name,
                  f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")

        integer("n", 1, b.max_n)
        number("temperature", 0.0, 100.0)
        number("top_p", 0.0, 1.0, lo_open=True)
        integer("top_k", -1, _INT64_MAX)
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 100.0, lo_open=True)
        if p.seed is not None:
            integer("seed", *SEED_RANGE)
        if p.max_tokens is not None:
            integer("max_tokens", 1, _INT64_MAX)
        integer("min_tokens", 0, _INT64_MAX)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(p, name) is not None:
                integer(name, 0, b.max_logprobs)
        check(len(p.stop) <= b.max_stop, "stop", f"at most {b.max_stop} stop sequences, got {len(p.stop)}")
        for s in p.stop:
            check(isinstance(s, str), "stop", "stop sequences must be strings")
            check(len(s) <= b.max_stop_chars, "stop",
                  f"a stop sequence may have at most {b.max_stop_chars} characters, got {len(s)}")
        ids = p.stop_token_ids
        check(len(ids) <= b.max_stop_token_ids, "stop_token_ids",
              f"at most {b.max_stop_token_ids} stop_token_ids, got {len(ids)}")
        check(all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids),
              "stop_token_ids", f"stop_token_ids must be token ids in [0, {self.vocab_size})")
        if p.logit_bias is not None:
            bias = p.logit_bias
            check(isinstance(bias, dict), "logit_bias", "logit_bias must map token ids to numbers")
            check(len(bias) <= b.max_logit_bias, "logit_bias",
                  f"logit_bias may have at most {b.max_logit_bias} entries, got {len(bias)}")
            for t, v in bias.items():
                check(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size, "logit_bias",
                      f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {t!r}")
                check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      and -100.0 <= v <= 100.0, "logit_bias", f"logit_bias values must be in [-100, 100], got {v!r}")
        pins = p.cache_pins
        check(len(pins) <= MAX_CACHE_PINS, "cache_control",
              f"at most {MAX_CACHE_PINS} cache_control breakpoints per request, got {len(pins)}")
        for pin in pins:
            check(isinstance(pin, CachePin) and pin.ttl_s in CACHE_TTLS.values(), "cache_control",
                  f"a cache_control ttl must be one of {', '.join(CACHE_TTLS)}")
            check(isinstance(pin.num_tokens, int) and pin.num_tokens >= 1, "cache_control",
                  "a cache_control breakpoint must follow at least one prompt token")
        if p.thinking_token_budget is not None:
            integer("thinking_token_budget", 1, _INT64_MAX)
            check(p.thinking is not None, "thinking_token_budget",
                  "thinking_token_budget needs a thinking model (serve --reasoning-parser)")
            least = p.thinking.min_budget
            check(p.thinking_token_budget >= least, "thinking_token_budget",
                  f"thinking_token_budget must be at least {least} (the thinking tags' tokens), "
                  f"got {p.thinking_token_budget}")
        if p.thinking is not None:
            tags = p.thinking.open_ids + p.thinking.close_ids
            check(bool(p.thinking.close_ids) and all(0 <= t < self.vocab_size for t in tags), "thinking",
                  "the thinking tags must be token ids of this model")
        if p.structured is not None:
            from tokenmill.engine.structured.grammar import validate  # llguidance, no torch

            validate(p.structured)


# -- the client seam --------------------------------------------------------------------
class UnknownModel(LookupError):
    """A request named a model (or adapter) this engine client does not serve."""

    def __init__(self, name: str, known: Sequence[str]):
        super().__init__(f"the model {name!r} does not exist; this server serves "
                         f"{', '.join(repr(k) for k in known)}")
        self.name = name


class ModelUnavailable(RuntimeError):
    """A model that exists could not be made ready for a request: its load failed, it does
    not fit the memory budget, or too many requests already wait for it. `code` names
    which (model_load_failed, model_too_large, model_queue_full); `retry_after` (seconds)
    is set when trying again later may succeed."""

    def __init__(self, message: str, code: str, retry_after: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


@dataclass(frozen=True)
class ServedModel:
    """One model an engine client serves, under the name requests give: what the server
    needs to turn a request into token ids and `ResolvedParams` before the engine sees it."""
    name: str
    tokenizer: Tokenizer | None
    config: ModelConfig
    defaults: GenerationDefaults  # the model's generation defaults, then the server's
    started_limits: RequestLimits | None  # None until the engine has started (its KV cache sized)
    snapshot: Snapshot | None = None  # None: a model built in memory, with no files to pin
    parent: str | None = None  # a LoRA adapter's base model (None: a model itself)
    embedding: EmbeddingSpec | None = None  # what /v1/embeddings may ask of it (None: nothing)

    @property
    def limits(self) -> RequestLimits:
        if self.started_limits is None:
            raise EngineDeadError(f"the engine serving {self.name!r} has not started")
        return self.started_limits

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def resolve(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                cap: int | None = None) -> ResolvedParams:
        return self.limits.resolve(prompts, params, defaults=self.defaults, cap=cap)


@runtime_checkable
class EngineClient(Protocol):
    """Everything the server, the cluster, the Batch API and the CLI may ask of an engine.
    Per-model facts (tokenizer, limits, generation defaults, context window) are keyed by
    the model name a request gives (`served`), so that one client may serve several
    models or adapters."""
    bounds: RequestBounds  # known before start: the server sizes its body limit by it
    error: BaseException | None  # set while the engine is dead
    gave_up: bool  # it died too often to be restarted: the server should exit
    on_give_up: Callable[[], None] | None

    @property
    def running(self) -> bool: ...

    def model_names(self) -> list[str]:
        """The names requests may give, the default model first (known before start)."""
        ...

    def served(self, model: str | None = None) -> ServedModel:
        """The model a request names (None: the default): its tokenizer and defaults known
        before start, its limits once started. Raises UnknownModel for a name not served."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: ResolvedParams, *,
                 model: str | None = None, priority: int = Priority.INTERACTIVE,
                 cache_salt: str | None = None, tenant: str | None = None,
                 arrival_time: float | None = None, deadline: float | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Run a resolved request (`ServedModel.resolve`); its outputs as they come. Raises
        EngineDeadError when the engine is not running."""
        ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def replica_stats(self) -> dict[str, dict] | None:
        """Per-replica figures behind a cluster ingress; None for a single engine."""
        ...

    async def load_adapter(self, name: str, path: str) -> dict:
        """Load a LoRA adapter (a PEFT folder or a llama.cpp LoRA GGUF) under `name`, which
        requests then give as their model: what it is (rank, modules, bytes, seconds).
        Raises InvalidParameter for a bad adapter or a taken name, EngineBusy when every
        adapter slot is held, having changed nothing."""
        ...

    async def unload_adapter(self, name: str) -> None: ...

    def tune(self, **knobs: int) -> None:
        """Change scheduling knobs while serving (TUNABLE: max_num_seqs,
        max_num_batched_tokens, decode_steps), from the next step on; kept across an
        engine restart. Raises ValueError for an unknown knob or a value below 1."""
        ...


class ModelLease(Protocol):
    """A hold on a loaded model: it is not unloaded until every lease is released."""

    def release(self) -> None:
        """Give the hold back (idempotent); the model's keep_alive runs from the last one."""
        ...


@runtime_checkable
class ModelHost(Protocol):
    """An engine client whose models load on demand and leave memory again
    (engine/models.py's `ModelRouter`). The server holds a lease on a request's model
    from before it resolves the request (which needs the model's limits) until the
    request ends."""
    budget: int  # bytes of memory the resident models' weights and KV caches may take

    def model_names(self) -> list[str]: ...

    async def acquire(self, model: str | None, keep_alive: float | None = None) -> ModelLease:
        """The model loaded (waiting for it if it is loading; loading it if not) and held.
        `keep_alive`: seconds it stays loaded once idle (None: the server's default;
        math.inf: until unloaded by hand; 0: unloaded when this request ends). Raises
        UnknownModel, or ModelUnavailable when it cannot be made ready."""
        ...

    async def load(self, model: str, keep_alive: float | None = None) -> None: ...

    async def unload(self, model: str) -> None:
        """Unload as soon as no request holds it (now, if none does)."""
        ...

    def model_states(self) -> list[dict]:
        """Per model, default first: id, state (loaded, loading, unloading, available),
        memory, keep_alive, loads and the last load error."""
        ...


TUNABLE = ("max_num_seqs", "max_num_batched_tokens", "decode_steps")


def check_knobs(knobs: dict[str, int]) -> dict[str, int]:
    for name, value in knobs.items():
        if name not in TUNABLE:
            raise ValueError(f"{name} cannot be tuned while serving; tunable: {', '.join(TUNABLE)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return dict(knobs)
