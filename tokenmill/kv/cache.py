"""The KV cache tensor, allocated once from a memory budget."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.model.memory import hugepage_zeros



class KVCache:
    """Preallocated K/V storage: [layers, 2, kv_heads, num_blocks * block_size, head_dim].

    Heads outermost so a sequence's context gathers into one contiguous run per head
    (see tokenmill.model.attention). With kv_dtype int8 the rows are symmetric int8 with
    one float32 scale per (layer, k or v, kv head, slot) in `scales`: half the bytes of
    bf16 for decode attention to read and twice the tokens in the same memory, for
    +0.26% perplexity (benchmarks/quality.py).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
                 head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = kv_dtype or dtype
        if self.dtype not in (dtype, torch.int8):
            raise ValueError(f"a KV cache holds the model's dtype or int8, not {self.dtype}")
        slots = num_blocks * block_size
        # (its pages are faulted in by a background thread: see hugepage_zeros)
        self.data = hugepage_zeros((num_layers, 2, num_kv_heads, slots, head_dim), self.dtype, background=True)
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]
        self.scales = None
        self._scales: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * num_layers
        if self.quantized:
            self.scales = hugepage_zeros((num_layers, 2, num_kv_heads, slots), torch.float32, background=True)
            self._scales = [(self.scales[i, 0], self.scales[i, 1]) for i in range(num_layers)]
        # byte views of the same memory, [layers, 2, kv_heads, slots, head_dim * itemsize]
        # (and [..., slots * 4] for the scales): whole blocks are copied with numpy, which
        # may run on another thread without starting a second OpenMP team beside the step's
        self._rows = self.data.view(torch.uint8).numpy()
        self._scale_rows = self.scales.view(torch.uint8).numpy() if self.quantized else None
        self._split = self._rows[..., :block_size, :].size  # a block's K/V bytes; its scales after

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def layer_scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer i's (k, v) scales [kv_heads, slots] for an int8 cache, else (None, None)."""
        return self._scales[i]

    # -- whole blocks as bytes (the disk tier, tokenmill/kv/disk.py) ---------------------------
    @property
    def block_nbytes(self) -> int:
        return self._split + (self._scale_rows[..., :4 * self.block_size].size if self.quantized else 0)

    @property
    def layout(self) -> str:
        """What a block's bytes mean: the order, shape and dtype they are copied in."""
        return (f"rows[layers,2,kv_heads,block,head_dim]={list(self._rows[..., :self.block_size, :].shape)}"
                f":{str(self.dtype).removeprefix('torch.')}" + (";scales:float32" if self.quantized else ""))

    def _slots(self, block_id: int) -> slice:
        return slice(block_id * self.block_size, (block_id + 1) * self.block_size)

    def read_block(self, block_id: int, out: np.ndarray) -> None:
        """Copy block `block_id`'s K/V (and scales) into `out`, a uint8 array of block_nbytes."""
        s = self._slots(block_id)
        rows = self._rows[:, :, :, s, :]
        np.copyto(out[:self._split].reshape(rows.shape), rows)
        if self._scale_rows is not None:
            scales = self._scale_rows[..., 4 * s.start:4 * s.stop]
            np.copyto(out[self._split:].reshape(scales.shape), scales)

    def write_block(self, block_id: int, src: np.ndarray) -> None:
        """The inverse of read_block: fill block `block_id` from `src`."""
        s = self._slots(block_id)
        rows = self._rows[:, :, :, s, :]
        np.copyto(rows, src[:self._split].reshape(rows.shape))
        if self._scale_rows is not None:
            scales = self._scale_rows[..., 4 * s.start:4 * s.stop]
            np.copyto(scales, src[self._split:].reshape(scales.shape))

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block takes in every layer: its K/V rows (of `dtype`, the cache's),
        and for int8 their float32 scales."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows = num_layers * 2 * num_kv_heads * block_size
        return rows * head_dim * itemsize + (rows * 4 if dtype == torch.int8 else 0)
