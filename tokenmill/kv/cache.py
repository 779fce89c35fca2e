"""The KV cache tensor, allocated once from a memory budget."""

from __future__ import annotations

import os

import torch

from tokenmill.model.memory import hugepage_zeros

GiB = 1024 ** 3


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_cache_bytes() -> int:
    """A quarter of free memory, at most 2 GiB: tens of thousands of tokens for a small model,
    and the pool is zero-filled at start (masked slots must hold finite values)."""
    return int(min(2 * GiB, 0.25 * available_memory_bytes()))


class KVCache:
    """Preallocated K/V storage: [layers, 2, kv_heads, num_blocks * block_size, head_dim].

    Heads outermost so a sequence's context gathers into one contiguous run per head
    (see tokenmill.model.attention).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
                 head_dim: int, dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = hugepage_zeros((num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim), dtype)
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * num_kv_heads * block_size * head_dim * itemsize
