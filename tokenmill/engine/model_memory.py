"""What the model router (engine/models.py) knows of memory, torch-free: the machine's
available memory, a model's weight files, an engine process's resident size."""

from __future__ import annotations

import os

from tokenmill.config import GiB, available_memory_bytes, default_cache_bytes


def default_budget_bytes() -> int:
    """80% of the memory available when the server starts."""
    return int(0.8 * available_memory_bytes())


def default_kv_cache_gb() -> float:
    """The single-model default (a quarter of available memory, at most 2 GiB), fixed
    once so that every model's estimate is what its engine allocates."""
    return default_cache_bytes() / GiB


def weights_bytes(path: str) -> int:
    """The model's weight files on disk: a GGUF's size, or a folder's *.safetensors."""
    if os.path.isdir(path):
        return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".safetensors") and e.is_file())
    return os.path.getsize(path)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
