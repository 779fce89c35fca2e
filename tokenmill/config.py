"""Frozen, layered configuration, resolved once before anything is built.

Each component receives only its own part (the scheduler gets SchedulerConfig). This
module imports nothing of tokenmill: every package may depend on it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestBounds:
    """What one request may ask for, whatever its tenant: the caps that keep a single
    query from costing the server unbounded work or memory (configurable)."""
    max_n: int = 16  # samples per prompt (n, best_of)
    max_prompts: int = 64  # prompts in one /v1/completions body
    max_logprobs: int = 20  # logprobs / top_logprobs
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters in one stop string
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300  # entries in logit_bias
    max_messages: int = 2048  # chat messages
    max_body_bytes: int = 8 * 1024 * 1024  # a larger HTTP body is refused with 413

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class ModelOptions:
    path: str | None = None  # None: the embedded SmolLM2 GGUF
    dtype: str = "float32"
    quantization: str = "none"  # none | int8 | int4 (weight-only; computes in bfloat16)
    served_name: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    # Greedy decode steps that may run as one engine step (the runner loops natively, not
    # returning to Python) when every scheduled request is a plain greedy decode and this
    # step admitted no one, divided among the requests: one sequence runs this many, 2 half
    # as many, and from this many sequences on there are no bursts. A burst so lasts about
    # as long as this many one-sequence steps (~4 ms each): tokens stream in bursts, and a
    # request arriving meanwhile waits for the burst's end. 1: one step at a time.
    decode_steps: int = 8
    # While interactive requests are in the engine, batch-class requests get this share
    # of the tokens steps process: each interactive token scheduled earns batch work
    # `batch_share` of a token, spent a token (a decode row or a prefill token) at a
    # time, and at most `batch_burst_tokens` in one step. On a CPU every row adds to the
    # step's time, so this is the share of live steps' time batch work may take: small,
    # but never nothing, so batch work does not starve. With no interactive work, batch
    # work takes steps of at most `batch_step_tokens` tokens: an interactive request that
    # arrives waits for the step in progress, so a short one keeps its TTFT.
    batch_share: float = 0.05
    batch_burst_tokens: int = 4
    batch_step_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.decode_steps < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and decode_steps must be positive")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError(f"batch_share must be in (0, 1], got {self.batch_share}")
        if self.batch_burst_tokens < 1 or self.batch_step_tokens < 1:
            raise ValueError("batch_burst_tokens and batch_step_tokens must be positive")


KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_gb: float | None = None  # None: a quarter of free memory, at most 2 GiB
    num_blocks: int | None = None  # explicit pool size (tests); overrides kv_cache_gb
    enable_prefix_caching: bool = True
    # auto: the model's dtype; int8: rows quantized per (token, kv head), half of bf16's bytes
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")


def default_num_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int | None = None  # None: the cores this process may use
    native_attention: bool = True  # the compiled paged-attention kernel (falls back to torch)
    bounds: RequestBounds = field(default_factory=RequestBounds)
