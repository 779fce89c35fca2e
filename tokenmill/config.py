"""Frozen, layered configuration, resolved once before anything is built.

Each component receives only its own part (the scheduler gets SchedulerConfig).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tokenmill.engine.scheduler import SchedulerConfig


@dataclass(frozen=True)
class ModelOptions:
    path: str | None = None  # None: the embedded SmolLM2 GGUF
    dtype: str = "float32"
    quantization: str = "none"  # none | int8 | int4 (weight-only; computes in bfloat16)
    served_name: str | None = None


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
