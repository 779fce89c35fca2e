"""Per-request block tables over the block pool, and automatic prefix caching.

The narrow API the scheduler uses says "can't" instead of raising:
`allocate_slots(...)` returns the request's blocks, or None when the pool cannot
hold them. Whom to preempt is the scheduler's decision, not ours.

Prefix caching: each full block is named by a hash chain over (parent hash, the
block's token ids, isolation key). The isolation key holds the tenant and the
request's cache_salt, so one tenant never hits another tenant's blocks. Only full
blocks are shared; a hit is verified against the stored token ids.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from tokenmill.kv.block_pool import BlockPool


class CacheableRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    tenant: str | None
    cache_salt: str | None

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[Hashable]] = {}
        self._num_published: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # -- queries ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------
    @staticmethod
    def isolation_key(req: CacheableRequest) -> Hashable:
        return (req.tenant, req.cache_salt)

    def _block_tokens(self, req: CacheableRequest, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(req.token_slice(i * bs, (i + 1) * bs))

    def _chain(self, req: CacheableRequest, num_full_blocks: int) -> list[Hashable]:
        """The request's block hashes for its first num_full_blocks blocks, extended lazily.
        Token ids never change once known, so the chain survives preemption."""
        hashes = self._hashes.setdefault(req.request_id, [])
        extra = self.isolation_key(req)
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash((parent, self._block_tokens(req, i), extra)))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, req: CacheableRequest, use_cache: bool = True) -> tuple[list[int], int]:
        """The longest run of cached full blocks that prefixes the request's tokens, and how
        many tokens they cover. At least one token is always left to compute (its logits
        are needed)."""
        if not (self.enable_caching and use_cache):
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._chain(req, max_blocks)):
            bid = self.pool.lookup(h, self._block_tokens(req, i))
            if bid is None:
                break
            hits.append(bid)
        return hits, len(hits) * self.block_size

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's first lookup (not retries, not resumptions)."""
        self.stats.requests += 1
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def cache_blocks(self, req: CacheableRequest) -> None:
        """Publish the request's newly full, computed blocks."""
        if not self.enable_caching:
            return
        rid = req.request_id
        n_full = req.num_computed_tokens // self.block_size
        start = self._num_published.get(rid, 0)
        if n_full <= start:
            return
        blocks = self._blocks[rid]
        hashes = self._chain(req, n_full)
        for i in range(start, n_full):
            self.pool.cache(blocks[i], hashes[i], self._block_tokens(req, i))
        self._num_published[rid] = n_full

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(self, req: CacheableRequest, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> list[int] | None:
        """Grow the request's block table to hold its computed tokens, `computed_blocks`
        (prefix hits, taken now) and num_new_tokens more. None if the pool can't."""
        rid = req.request_id
        blocks = self._blocks.get(rid, [])
        total_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        n_new = max(0, self.blocks_needed(total_tokens) - len(blocks) - len(computed_blocks))
        # Hits that sit on the free list leave it when touched, so they count against room.
        n_revived = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if n_new + n_revived > self.pool.num_free_blocks:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            self._num_published[rid] = len(blocks) + len(computed_blocks)
        new = self.pool.allocate(n_new) if n_new else []
        assert new is not None
        blocks = self._blocks.setdefault(rid, [])
        blocks.extend(computed_blocks)
        blocks.extend(new)
        return blocks

    def fork(self, src: CacheableRequest, dst: CacheableRequest, num_blocks: int) -> list[int]:
        """Share src's first num_blocks (full, computed) blocks with dst, which holds none."""
        assert not self._blocks.get(dst.request_id), "fork target already holds blocks"
        shared = self._blocks[src.request_id][:num_blocks]
        self.pool.touch(shared)
        self._blocks[dst.request_id] = list(shared)
        self._num_published[dst.request_id] = min(self._num_published.get(src.request_id, 0), num_blocks)
        return self._blocks[dst.request_id]

    def free(self, req: CacheableRequest, finished: bool = True) -> None:
        """Release the request's blocks, tail first. A preempted request keeps its hash chain."""
        rid = req.request_id
        blocks = self._blocks.pop(rid, [])
        self.pool.free(reversed(blocks))
        self._num_published.pop(rid, None)
        if finished:
            self._hashes.pop(rid, None)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for blocks in self._blocks.values():
            for b in blocks:
                refs[b] += 1
        for b in self.pool.blocks:
            assert refs[b.block_id] == b.ref_cnt, f"block {b.block_id}: {refs[b.block_id]} holders, ref {b.ref_cnt}"
