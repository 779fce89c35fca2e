"""CUDA graphs for the torch runner's decode steps (issue 46).

A decode-only step's every shape is set by its row count and its block tables' width,
so each (rows, width) bucket is captured once as a CUDA graph over static buffers and
replayed: rows in powers of two up to the largest decode batch, widths in powers of two
up to the blocks of the longest context. A step runs in the smallest bucket that holds
it; its padding rows read token 0 at position 0 through a table of the scratch block
(TorchKVCache.scratch_block), so they write nowhere a sequence reads, and their logits
are dropped. A step outside every bucket (more rows than the largest) runs eagerly.

Graphs are captured on a bucket's first use, not at start: rows x widths is tens of
buckets, most of which a given load never reaches. `capture=None` replaces capture by
an eager call on the same buffers, which is how the CPU tests exercise the bucket logic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# (input_ids, positions, slots, tables, lens) -> float32 logits [rows, vocab]
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _powers_up_to(limit: int, base: tuple[int, ...] | None = None) -> list[int]:
    sizes = [x for x in (base or [1 << i for i in range(32)]) if x < limit]
    return sizes + [limit]


def cuda_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor, object]:
    """Capture `fn` as a CUDA graph in memory pool `pool` (None: a new one) after one
    warm-up run on a side stream (kernels chosen, workspaces allocated before capture):
    (replay, the output it writes, the pool)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out, graph.pool()


def eager_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor, object]:
    """Capture replaced by eager calls: each replay runs `fn` on the same static buffers
    and writes its output where a graph's would be."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())
    return replay, out, pool


class DecodeGraphs:
    def __init__(self, step: DecodeStep, max_rows: int, max_blocks: int, scratch_block: int,
                 device: torch.device, capture=cuda_capture):
        self.step = step
        self.capture = capture
        self.rows = _powers_up_to(max_rows, ROW_BUCKETS)
        self.widths = _powers_up_to(max_blocks)
        self.scratch_block = scratch_block
        self.block_size = 0  # set by the runner (the scratch slot is scratch_block * block_size)
        R, W = self.rows[-1], self.widths[-1]
        z = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(R, **z)
        self.positions = torch.zeros(R, **z)
        self.slots = torch.zeros(R, **z)
        self.tables = torch.full((R, W), scratch_block, **z)
        self.lens = torch.ones(R, **z)
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}
        self._pool = None

    def bucket(self, rows: int, blocks: int) -> tuple[int, int] | None:
        """The smallest (rows, width) bucket holding a step, or None: run it eagerly."""
        if rows > self.rows[-1] or blocks > self.widths[-1]:
            return None
        return next(r for r in self.rows if r >= rows), next(w for w in self.widths if w >= blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of a decode-only step (device tensors, tables [rows, blocks])."""
        n, blocks = tables.shape
        key = self.bucket(n, blocks)
        if key is None:
            return self.step(input_ids, positions, slots, tables, lens)
        R, W = key
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.tables[:n, :blocks].copy_(tables)
        self.lens[:n].copy_(lens)
        # padding: rows past n, and columns past each row's table (the tail is never read)
        self.input_ids[n:R].zero_()
        self.positions[n:R].zero_()
        self.slots[n:R].fill_(self.scratch_block * self.block_size)
        self.tables[n:R, :W].fill_(self.scratch_block)
        self.tables[:n, blocks:W].fill_(self.scratch_block)
        self.lens[n:R].fill_(1)
        if key not in self.graphs:
            fn = (lambda: self.step(self.input_ids[:R], self.positions[:R], self.slots[:R], self.tables[:R, :W],
                                    self.lens[:R]))
            replay, out, self._pool = self.capture(fn, self._pool)
            self.graphs[key] = (replay, out)
        replay, out = self.graphs[key]
        replay()
        return out[:n]
