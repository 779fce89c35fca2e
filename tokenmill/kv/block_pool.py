"""Ref-counted KV blocks with an LRU free list that doubles as the prefix cache's
eviction order. Pure Python: block ids and counters, no tensors.

Every block is in exactly one of three states:
  in use       ref_cnt > 0 (held by one or more requests; never evicted)
  cached free  ref_cnt == 0, has a hash (reusable on a hit, evicted lazily)
  free         ref_cnt == 0, no hash
Free and cached-free blocks share one ordered free list: allocation takes from the
front (least recently freed), so cached blocks are evicted LRU. A cache hit takes a
block out of the middle of the list in O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to verify hits against collisions


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[Block], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # called with a cached block (hash and tokens still set) just before allocation
        # reuses it: its contents are about to be overwritten (the disk tier saves them)
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[Hashable, int] = {}
        self.num_evictions = 0

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-free)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: Hashable, token_ids: tuple[int, ...]) -> int | None:
        bid = self._cached.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != token_ids:
            return None
        return bid

    # -- transitions --------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref_cnt 1), evicting cached ones as needed; None if there are not n."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                self._evict(block)
            block.ref_cnt = 1
            out.append(bid)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on already-filled blocks (a prefix hit or a fork)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                del self._free[bid]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block, in the order given (callers pass tail first, so a
        request's last blocks are evicted before the shared prefix they extend)."""
        for bid in block_ids:
            block = self.blocks[bid]
            assert block.ref_cnt > 0, f"double free of block {bid}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[bid] = None

    def cache(self, block_id: int, block_hash: Hashable, token_ids: tuple[int, ...]) -> bool:
        """Publish a full, computed block under its hash. The first writer of a hash wins;
        a duplicate computed concurrently stays private and is freed normally. True: this
        call published it."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block_id
        return True

    def _evict(self, block: Block) -> None:
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1

    def reset_cache(self) -> None:
        """Forget every cached-free block's hash (in-use blocks keep theirs)."""
        for bid in list(self._free):
            block = self.blocks[bid]
            if block.block_hash is not None:
                self._evict(block)

    def check_integrity(self) -> None:
        """free + in use == total; refcounts and the hash index agree. Tests call this."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(in_use) + len(self._free) == self.num_blocks, "leaked or double-listed block"
        for bid in self._free:
            assert self.blocks[bid].ref_cnt == 0, f"free block {bid} has references"
        for b in self.blocks:
            assert b.ref_cnt >= 0
            if b.ref_cnt == 0:
                assert b.block_id in self._free, f"unreferenced block {b.block_id} not on the free list"
        for h, bid in self._cached.items():
            assert self.blocks[bid].block_hash == h, "hash index out of sync"
        assert sum(1 for b in self.blocks if b.block_hash is not None) == len(self._cached)
