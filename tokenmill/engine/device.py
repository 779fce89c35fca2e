"""Where the model runs (issue 46): the device and runner an EngineConfig asks for, made
concrete, and the KV pool a GPU's memory allows.

Resolved in the engine's thread or process, where torch is loaded anyway: `auto` is cuda
when torch sees a CUDA device, else the CPU; the runner is the torch runner on cuda and
the native one on the CPU unless asked. The torch runner computes with dense weights, so
the default quantization (`auto`: int4/int8 for the native kernels) becomes none there,
and an explicit int8 or int4 is refused.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.config import EngineConfig


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve(config: EngineConfig) -> EngineConfig:
    """`config` with device in (cpu, cuda) and runner in (native, torch); ValueError for
    what cannot run here (cuda without a GPU, quantized weights on the torch runner)."""
    device = config.device
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    elif device == "cuda" and not cuda_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    runner = config.runner
    if runner == "auto":
        runner = "torch" if device == "cuda" else "native"
    if device == "cuda" and runner == "native":
        raise ValueError("the native runner runs on the CPU only; cuda takes the torch runner")
    model = config.model
    if runner == "torch":
        if model.quantization in ("int8", "int4"):
            raise ValueError(f"--quantization {model.quantization} has no torch-runner path yet: the torch runner "
                             "computes with dense weights (--quantization none)")
        if model.quantization != "none":
            model = dataclasses.replace(model, quantization="none")
        if config.cache.kv_cache_dtype != "auto":
            raise ValueError("the torch runner keeps the KV cache in the model's dtype (--kv-cache-dtype auto)")
        if config.cache.kv_disk_dir:
            raise ValueError("the torch runner has no KV disk tier yet (--kv-disk-dir)")
        if config.lora.max_loras:
            raise ValueError("the torch runner has no LoRA path yet")
    return dataclasses.replace(config, device=device, runner=runner, model=model)


def gpu_cache_bytes(utilization: float, free: int, total: int) -> int:
    """The KV pool's bytes on a GPU with `free` of `total` bytes free once the weights are
    there: what keeps the process (and anything else on the device) within `utilization`
    of it. Activations and CUDA graphs come out of the rest (10% of an H100 at the
    default 0.9 is ~8 GiB)."""
    return max(0, int(free - (1.0 - utilization) * total))


def describe(config: EngineConfig) -> str:
    """The start line's words for where the model runs."""
    if config.device == "cuda":
        name = torch.cuda.get_device_name()
        graphs = "CUDA graphs for decode steps (captured per bucket on first use)" if config.cuda_graphs \
            else "no CUDA graphs"
        return f"cuda ({name}), torch runner, {graphs}"
    return f"cpu, {config.runner} runner"
