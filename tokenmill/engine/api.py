"""The engine's public face: the only engine module the server, the CLI and other
clients import. It imports no torch.

- `EngineClient`: what a client of the engine may do (start, stop, check, generate,
  abort, stats). `AsyncEngine` (step loop in a thread) and `ProcessEngine` (in a child
  process) implement it; `make_engine` picks one.
- `SamplingParams`, `RequestOutput`, `TokenLogprob`, `Choice`, `EngineStats`: the data
  that crosses the seam.
- `RequestLimits.check`: every bound a request must meet, checked in one place before
  any work is allocated. A violation raises `InvalidParameter` (or `AdmissionError` for
  the context window) naming the parameter; the server turns both into a 400.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from tokenmill.config import (CacheConfig, EngineConfig, ModelOptions, RequestBounds, SchedulerConfig,
                              SpeculativeConfig)

if TYPE_CHECKING:
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.tokenizer import Tokenizer

__all__ = [
    "AdmissionError", "CacheConfig", "Choice", "EngineClient", "EngineConfig", "EngineDeadError",
    "EngineStats", "InvalidParameter", "ModelOptions", "Priority", "RequestBounds", "RequestLimits",
    "RequestOutput", "RequestTimes", "SamplingParams", "SchedulerConfig", "SpeculativeConfig", "StructuredOutput",
    "TokenLogprob", "make_engine",
]


# -- errors -----------------------------------------------------------------------------
class InvalidParameter(ValueError):
    """A request parameter out of bounds; `param` names it as the client sent it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class AdmissionError(ValueError):
    """A request that can never be served (too long for the context or the cache)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine stopped; requests in flight cannot complete."""


class Priority(enum.IntEnum):
    """Request classes; lower value is served first."""
    INTERACTIVE = 0
    BATCH = 1


# -- request ----------------------------------------------------------------------------
# A temperature this small is greedy decoding: dividing fp32 logits by it overflows to
# inf (and the softmax to NaN), so it is taken as the limit it tends to.
GREEDY_BELOW = 1e-5

@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, which the engine compiles to a grammar
    (tokenmill/engine/structured) and enforces token by token. `kind` and `value`:
    json (a JSON schema, as a dict or a JSON string), json_object (None: any JSON
    object), regex (a regular expression the whole output matches), choice (a list of
    strings: the output is one of them), grammar (a Lark grammar)."""
    KINDS: ClassVar[tuple[str, ...]] = ("json", "json_object", "regex", "choice", "grammar")
    kind: str
    value: Any = None


@dataclass
class SamplingParams:
    """How one request wants its tokens chosen and when it wants to stop. Value ranges
    are checked by `RequestLimits.check`, not here: construction never raises, so the
    one check sees the request as the client sent it."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context window (resolved by check)
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus top-k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured: StructuredOutput | None = None  # output constrained by a grammar (None: free text)
    speculative: bool = True  # False: no speculative drafts for this request (the output is the same)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


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
        if p.structured is not None:
            from tokenmill.engine.structured.grammar import validate  # llguidance, no torch

            validate(p.structured)


# -- outputs ----------------------------------------------------------------------------
@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)
    finished: float | None = None
    preempted: list[float] = field(default_factory=list)  # when it lost its KV blocks (recomputed later)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the first prompt token, which nothing predicts
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """One step's news about one sample (index) of one user request."""
    request_id: str  # the user request's id (shared by its n samples)
    index: int
    new_token_ids: list[int]
    text: str  # new text since the last output
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # position 0 has none
    times: RequestTimes | None = None
    # speculative decoding, so far: drafts the model checked for this sample, and how
    # many it accepted (the output is the same either way)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class Choice:
    """One sample of a request, accumulated from its outputs."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    times: RequestTimes | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.new_token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason, self.stop_reason, self.times = out.finish_reason, out.stop_reason, out.times


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_interactive: int = 0
    num_waiting_batch: int = 0
    oldest_waiting_s: float = 0.0  # how long the longest-waiting interactive request has waited
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    steps: int = 0
    engine_restarts: int = 0  # times the engine was restarted after it died
    spec_draft_tokens: int = 0  # speculative drafts checked by the model
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verifications: int = 0  # request-steps that checked drafts


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


ENGINE_MODES = ("process", "thread")
TUNABLE = ("max_num_seqs", "max_num_batched_tokens", "decode_steps")


def check_knobs(knobs: dict[str, int]) -> dict[str, int]:
    for name, value in knobs.items():
        if name not in TUNABLE:
            raise ValueError(f"{name} cannot be tuned while serving; tunable: {', '.join(TUNABLE)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return dict(knobs)


def make_engine(config: EngineConfig, mode: str = "process") -> EngineClient:
    """An engine client for `config`: `process` runs the step loop in a child process
    (restarted if it dies), `thread` in a thread of this one. Only metadata is read
    now; weights load when the client starts."""
    if mode == "process":
        from tokenmill.engine.process_engine import ProcessEngine

        return ProcessEngine(config)
    if mode == "thread":
        from tokenmill.engine.async_engine import AsyncEngine

        return AsyncEngine.load(config)
    raise ValueError(f"engine mode must be one of {', '.join(ENGINE_MODES)}, got {mode!r}")
