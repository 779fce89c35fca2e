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
    max_prompts: int = 64  # prompts in one /v1/completions body (inputs to /v1/embeddings, /v1/rerank)
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


DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True)
class ModelOptions:
    path: str | None = None  # None: the embedded SmolLM2 GGUF
    dtype: str = "float32"
    quantization: str = "none"  # none | int8 | int4 (weight-only; computes in bfloat16)
    activation_levels: int | None = None  # 1 or 2 (model/loader.set_activation_levels); None: the model's
    served_name: str | None = None  # what requests call it (default: the model's own name)
    # Sampling where a request says nothing: "auto" the model's own generation defaults
    # (tokenmill/model/generation.py), "none" the API's (temperature 1, no truncation),
    # or a generation_config.json file of the operator's
    generation_config: str = "auto"
    # The output cap of a request that sets no max_tokens, after the model's own
    # defaults: a silent request at a small model's temperature could otherwise hold a
    # sequence slot until the context is full. None: up to the context window.
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be positive, got {self.default_max_tokens}")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (tokenmill/model/lora.py): those loaded at start, and the bounds of
    what may be loaded later. max_loras 0: no adapters (no slots, nothing per row)."""
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start
    max_loras: int = 0  # adapters resident at once; the least recently used idle one makes room
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
        if len(self.adapters) > self.max_loras:
            raise ValueError(f"{len(self.adapters)} adapters at start but max_loras is {self.max_loras}")


SPECULATIVE_METHODS = ("off", "ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding from text (tokenmill/engine/spec): drafts proposed from the
    request's own prompt and output (ngram: prompt lookup) and, for suffix, also from the
    recent outputs of the same tenant; the model checks them in one step.

    How many drafts a request gets each step is decided per step: a draft is worth a row
    when the chance that it is accepted (the request's measured acceptance, to the power
    of its place in the run) pays for the row's cost, `row_cost` of a one-row step, at
    the tokens per unit of time the step makes without it. So a request whose drafts
    miss stops drafting, and a big batch (each row already costs nearly a full row of
    compute) drafts only what is almost surely accepted."""
    method: str = "off"
    num_speculative_tokens: int = 5  # at most this many drafts for one request in one step
    prompt_lookup_min: int = 2  # n-gram lengths matched, longest first
    prompt_lookup_max: int = 5
    # suffix: n-gram lengths the suffix index matches, and how much of each tenant's
    # recent output it keeps (oldest dropped first), over at most `suffix_max_tenants`
    suffix_max_match: int = 8
    suffix_min_prob: float = 0.1  # a run stops where its continuation's frequency falls below
    suffix_max_tokens: int = 65536
    suffix_max_tenants: int = 64
    # One more row's share of a one-row step's time (measured on the fused int4 step:
    # 2.65 ms for one row, 4.6 for four, 8.4 for eight): the price of a draft
    row_cost: float = 0.35
    max_rows: int = 16  # no drafts beyond this many decode rows in a step

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.suffix_max_match < self.prompt_lookup_min:
            raise ValueError("suffix_max_match must be at least prompt_lookup_min")
        if not 0.0 < self.row_cost <= 1.0:
            raise ValueError(f"row_cost must be in (0, 1], got {self.row_cost}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

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
    # The prefix cache's disk tier (tokenmill/kv/tier.py): full blocks evicted from memory
    # (and, with write-through, every block as it is computed) kept in files under this
    # directory, at most kv_disk_gb of them; a prompt whose prefix memory lacks reads it
    # back instead of recomputing it, after a restart too. None: memory only.
    kv_disk_dir: str | None = None
    kv_disk_gb: float = 10.0
    kv_disk_write_through: bool = True
    # cache_control breakpoints (kept cached for their TTL): the share of the pool one
    # tenant may pin (all tenants together: at most half)
    pin_share_per_tenant: float = 0.25
    # On a GPU (the torch runner on cuda), with no kv_cache_gb: the share of the device's
    # memory the process may hold, the KV pool taking what the weights leave of it
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if not 0.0 <= self.pin_share_per_tenant <= 0.5:
            raise ValueError(f"pin_share_per_tenant must be in [0, 0.5], got {self.pin_share_per_tenant}")
        if self.kv_disk_gb <= 0:
            raise ValueError(f"kv_disk_gb must be positive, got {self.kv_disk_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_disk_dir is not None and not self.enable_prefix_caching:
            raise ValueError("the KV disk tier keeps prefix-cache blocks: it needs prefix caching on")


GiB = 1024 ** 3


def available_memory_bytes() -> int:
    """MemAvailable (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_cache_bytes() -> int:
    """The KV cache of an engine given no size: a quarter of free memory, at most 2 GiB
    (tens of thousands of tokens for a small model; the pool is zero-filled)."""
    return int(min(2 * GiB, 0.25 * available_memory_bytes()))


def default_num_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


DEVICES = ("auto", "cpu", "cuda")
RUNNERS = ("auto", "native", "torch")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None  # None: the model's own context length
    num_threads: int | None = None  # None: the cores this process may use
    native_attention: bool = True  # the compiled paged-attention kernel (falls back to torch)
    # Where the model runs: cpu, cuda, or auto (cuda when torch sees one). runner: native
    # (the CPU kernels), torch (PyTorch ops only, any device: tokenmill/engine/torch_runner.py)
    # or auto (torch on cuda, native on cpu). tokenmill/engine/device.py resolves both.
    device: str = "cpu"
    runner: str = "auto"
    cuda_graphs: bool = True  # decode steps replayed as CUDA graphs (cuda only)
    bounds: RequestBounds = field(default_factory=RequestBounds)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # A process engine whose child shows no sign of life (heartbeat, output) this long is
    # declared hung, killed and replaced (engine/process_engine.py); 0: never.
    hang_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.device == "cuda" and self.runner == "native":
            raise ValueError("the native runner runs on the CPU only; cuda takes the torch runner")
