"""The data that crosses the engine's seam: errors, request classes, sampling
parameters, outputs and stats. A leaf: it imports nothing of tokenmill
and no torch, so every layer (engine internals, server, cluster, batch) may import it.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "AdmissionError", "CACHE_TTLS", "CachePin", "Choice", "EmbeddingSpec", "EngineBusy", "EngineDeadError",
    "EngineHungError", "EngineStats", "GREEDY_BELOW", "GenerationDefaults", "InvalidParameter", "POOLINGS", "Priority", "RequestOutput",
    "RequestTimes", "ResolvedParams", "SamplingParams", "Snapshot", "SnapshotMismatch", "StructuredOutput",
    "TokenLogprob", "split_snapshot_id", "text_digest",
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


class EngineBusy(RuntimeError):
    """A request the engine cannot take now but could soon (every LoRA slot is held by
    requests in flight): retry."""


class EngineDeadError(RuntimeError):
    """The engine stopped; requests in flight cannot complete."""


class EngineHungError(EngineDeadError):
    """The engine stopped answering (its process stopped or stuck): it was killed and is
    being replaced; requests in flight cannot complete."""


class SnapshotMismatch(LookupError):
    """A request pinned a model snapshot (`NAME@sha256:<hex>`) that is not the one served."""

    def __init__(self, requested: str, served: str):
        super().__init__(f"the model snapshot {requested!r} is not the one this server runs: it serves "
                         f"{served!r} (its weights, tokenizer, template or settings changed); request {served!r} "
                         "or the bare name to accept it")
        self.requested = requested
        self.served = served


class Priority(enum.IntEnum):
    """Request classes; lower value is served first."""
    INTERACTIVE = 0
    BATCH = 1


# -- model snapshots ---------------------------------------------------------------------
SNAPSHOT_SEP = "@sha256:"
SNAPSHOT_HEX = 12  # hex digits of the digest an id shows (and a pin must give at least)


@dataclass(frozen=True)
class Snapshot:
    """What decides a served model's outputs, as a manifest of hashes and settings
    (tokenmill/model/snapshot.py builds it from file metadata, before weights load):
    weights, tokenizer, chat template, precision, KV settings, generation defaults,
    tokenmill's version and the native kernels' build key. Its id, `NAME@sha256:<12 hex>`,
    is the name plus a digest of the manifest (the name is not hashed: one snapshot may
    be served under several names), reported as `system_fingerprint` and accepted as a
    pinned `model`."""
    name: str
    manifest: dict[str, Any] = field(hash=False)

    @property
    def digest(self) -> str:
        text = json.dumps(self.manifest, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def id(self) -> str:
        return f"{self.name}{SNAPSHOT_SEP}{self.digest[:SNAPSHOT_HEX]}"

    def replace(self, **parts: Any) -> Snapshot:
        """The same snapshot with manifest entries replaced (a server's own chat template)."""
        return Snapshot(self.name, {**self.manifest, **parts})

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "digest": f"sha256:{self.digest}", "manifest": self.manifest}

    def check(self, requested: str) -> None:
        """Raise SnapshotMismatch unless `requested` (a pinned id) names this snapshot: its
        hex a prefix of the digest, at least SNAPSHOT_HEX digits long."""
        _, pin = split_snapshot_id(requested)
        if pin is None:
            return
        if len(pin) < SNAPSHOT_HEX or not self.digest.startswith(pin.lower()):
            raise SnapshotMismatch(requested, self.id)


def text_digest(text: str) -> str:
    """A manifest's digest of a text part (the chat template, the tokenizer)."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_snapshot_id(model: str) -> tuple[str, str | None]:
    """(name, the pinned digest's hex or None) of a request's `model`."""
    name, sep, pin = model.partition(SNAPSHOT_SEP)
    return (name, pin) if sep else (model, None)


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


# How an embedding request pools its prompt's final hidden states (after the final norm):
# the last token's (what a causal model has read the whole prompt into) or their mean
POOLINGS = ("last", "mean", "cls")


@dataclass(frozen=True)
class EmbeddingSpec:
    """What a served model's embeddings are (ServedModel.embedding): their size, the
    poolings a request may ask for (the first is the default), the sizes `dimensions` may
    truncate them to (a Matryoshka-trained model; None: none, (): any up to `size`), and
    whether the model also generates text (an encoder does not)."""
    size: int
    poolings: tuple[str, ...]
    truncatable: tuple[int, ...] | None
    generates: bool


# Prompt-cache TTLs a client may ask for (Anthropic's cache_control "ttl"), in seconds
CACHE_TTLS = {"5m": 300, "1h": 3600}
MAX_CACHE_PINS = 4  # breakpoints per request, as Anthropic allows


@dataclass(frozen=True)
class CachePin:
    """Keep the prompt's first `num_tokens` tokens cached for `ttl_s` seconds from this
    request's use of them (a cache_control breakpoint): their full blocks stay in memory
    against eviction until then, within the tenant's share of the pool."""
    num_tokens: int
    ttl_s: int


@dataclass(frozen=True)
class ThinkingTags:
    """A thinking model's reasoning block as token ids (the server finds them in its
    tokenizer; the engine sees ids only). The engine counts the reply's reasoning tokens
    (tags included) and, with a budget, closes the block when it is spent."""
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    inside: bool = False  # the prompt opened the block: the reply starts thinking
    always: bool = False  # the reply thinks from its first token (deepseek_r1), opened or not

    @property
    def min_budget(self) -> int:
        """The fewest reasoning tokens a budget may allow: room for the tags."""
        return len(self.close_ids) + (0 if self.inside else len(self.open_ids))


@dataclass
class SamplingParams:
    """How one request wants its tokens chosen and when it wants to stop, as the client
    said it: unchecked, and None where it said nothing (the sampling fields and
    max_tokens), so the model's generation defaults can fill the gaps.
    `RequestLimits.resolve` turns it, once, into the `ResolvedParams` the engine runs:
    construction here never raises, so that one check sees the request as sent."""
    n: int = 1
    temperature: float | None = None  # None: the model's default, else 1
    top_p: float | None = None  # None: the model's default, else 1 (off)
    top_k: int | None = None  # 0 or -1: off; None: the model's default, else off
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: the server's default for silent requests, else the room left
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus top-k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured: StructuredOutput | None = None  # output constrained by a grammar (None: free text)
    speculative: bool = True  # False: no speculative drafts for this request (the output is the same)
    cache_pins: tuple[CachePin, ...] = ()  # prompt prefixes to keep cached (cache_control)
    thinking: ThinkingTags | None = None  # a thinking model's tags (None: replies are not parsed for thinking)
    thinking_token_budget: int | None = None  # most reasoning tokens, tags included (None: unbounded)
    # an embedding request (POOLINGS): the prompt's final hidden states pooled, nothing decoded
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a sampling field (or max_tokens) unset gets: the
    model's own recommendation (GGUF `general.sampling.*`, `generation_config.json`,
    an install recipe), then the server's. None: no default (the API's own applies)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None  # the output cap of a request that sets none

    FIELDS: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                         "presence_penalty", "frequency_penalty", "max_tokens")

    def over(self, base: GenerationDefaults) -> GenerationDefaults:
        """These defaults, falling back to `base` where they say nothing."""
        return GenerationDefaults(**{f: getattr(self, f) if getattr(self, f) is not None else getattr(base, f)
                                     for f in self.FIELDS})

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS if getattr(self, f) is not None}


@dataclass(frozen=True, kw_only=True)
class ResolvedParams:
    """A request's parameters checked against every bound and normalized, once
    (`RequestLimits.resolve`): the only form the engine accepts. Defaults applied,
    max_tokens a number (the tenant's cap included), greedy decided (then temperature is
    0), top_k in [0, vocab] (0: off)."""
    n: int
    greedy: bool
    temperature: float  # 0.0 when greedy
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    logit_bias: dict[int, float] | None
    structured: StructuredOutput | None
    speculative: bool
    cache_pins: tuple[CachePin, ...]
    thinking: ThinkingTags | None = None
    thinking_token_budget: int | None = None  # set only with thinking
    pooling: str | None = None  # an embedding request: max_tokens is 0, the output is `embedding`

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


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
    # prompt tokens this request wrote to the cache under its cache pins, by TTL in seconds
    # (tokens it read from the cache are num_cached_tokens)
    cache_write_tokens: dict[int, int] = field(default_factory=dict)
    num_reasoning_tokens: int = 0  # of the output so far, inside the thinking block (tags included)
    # an embedding request's pooled final hidden state, on its finished output (a decoder's
    # is not normalized; an encoder's has the model's own normalization, if any)
    embedding: list[float] | None = None


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
    num_reasoning_tokens: int = 0
    times: RequestTimes | None = None

    def add(self, out: RequestOutput) -> None:
        self.num_reasoning_tokens = out.num_reasoning_tokens
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
    kv_pinned_blocks: int = 0  # blocks cache_control breakpoints keep in memory until their TTL
    # the prefix cache's disk tier (prefix_hits counts blocks read back from disk too)
    kv_disk_lookup_tokens: int = 0  # prompt tokens in full blocks memory lacked, looked up on disk
    kv_disk_hit_tokens: int = 0  # of those, read back from disk
    kv_disk_read_bytes: int = 0
    kv_disk_written_bytes: int = 0
    kv_disk_restores: int = 0  # prefixes read back
    kv_disk_restore_seconds: float = 0.0  # summed: from the lookup to the blocks being ready
    kv_disk_used_bytes: int = 0
    kv_disk_capacity_bytes: int = 0
    kv_disk_files: int = 0
    kv_disk_faults: int = 0  # bad files (truncated, corrupt, foreign), failed writes (no space, I/O)
