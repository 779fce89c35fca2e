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
from tokenmill.engine.types import (CACHE_TTLS, GREEDY_BELOW, MAX_CACHE_PINS, AdmissionError, CachePin, Choice,
                                    EngineDeadError, EngineStats, InvalidParameter, Priority, RequestOutput,
                                    RequestTimes, SamplingParams, StructuredOutput, TokenLogprob)

if TYPE_CHECKING:
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.tokenizer import Tokenizer

__all__ = [
    "AdmissionError", "CACHE_TTLS", "CacheConfig", "CachePin", "Choice", "EngineClient", "EngineConfig", "EngineDeadError",
    "EngineStats", "GREEDY_BELOW", "InvalidParameter", "ModelOptions", "Priority", "RequestBounds",
    "RequestLimits", "RequestOutput", "RequestTimes", "SamplingParams", "SchedulerConfig", "SpeculativeConfig",
    "StructuredOutput", "TokenLogprob", "TUNABLE", "check_knobs",
]


SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what a torch generator accepts (negatives wrap)
_INT64_MAX = 2 ** 63 - 1


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one served model: the request caps, its vocabulary, its context
    window and KV cache. Pure data, so a front end in another process can refuse a
    request without asking the engine."""
    max_model_len: int
    cache_tokens: int
    vocab_size: int
    bounds: RequestBounds = field(default_factory=RequestBounds)

    def check(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SamplingParams:
        """Check a request (one or more token-id prompts sharing `params`) against every
        bound. Returns params with max_tokens resolved (the room left in the context
        when the client set none); raises InvalidParameter / AdmissionError."""
        self.check_params(params)
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
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - longest
            if max_tokens < 1:
                raise AdmissionError(
                    f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                    f"has {longest} tokens", param="messages")
        self.check_fits(longest, max_tokens)
        if params.min_tokens > max_tokens:
            raise InvalidParameter("min_tokens", f"min_tokens ({params.min_tokens}) must not exceed "
                                                 f"max_tokens ({max_tokens})")
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        return params

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
        if p.structured is not None:
            from tokenmill.engine.structured.grammar import validate  # llguidance, no torch

            validate(p.structured)


# -- the client seam --------------------------------------------------------------------
@runtime_checkable
class EngineClient(Protocol):
    """What the server (and any other client) may ask of an engine."""
    tokenizer: Tokenizer | None
    model_config: ModelConfig
    bounds: RequestBounds  # known before start
    error: BaseException | None  # set while the engine is dead
    gave_up: bool  # it died too often to be restarted: the server should exit
    on_give_up: Callable[[], None] | None

    @property
    def running(self) -> bool: ...

    @property
    def limits(self) -> RequestLimits: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def check(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SamplingParams: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = Priority.INTERACTIVE, cache_salt: str | None = None,
                 tenant: str | None = None, arrival_time: float | None = None,
                 deadline: float | None = None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def tune(self, **knobs: int) -> None:
        """Change scheduling knobs while serving (TUNABLE: max_num_seqs,
        max_num_batched_tokens, decode_steps), from the next step on; kept across an
        engine restart. Raises ValueError for an unknown knob or a value below 1."""
        ...


TUNABLE = ("max_num_seqs", "max_num_batched_tokens", "decode_steps")


def check_knobs(knobs: dict[str, int]) -> dict[str, int]:
    for name, value in knobs.items():
        if name not in TUNABLE:
            raise ValueError(f"{name} cannot be tuned while serving; tunable: {', '.join(TUNABLE)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return dict(knobs)
