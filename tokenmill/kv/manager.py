"""Per-request block tables over the block pool, and automatic prefix caching.

The narrow API the scheduler uses says "can't" instead of raising:
`allocate_slots(...)` returns the request's blocks, or None when the pool cannot
hold them. Whom to preempt is the scheduler's decision, not ours.

Prefix caching: each full block is named by a hash chain over (parent hash, the
block's token ids), rooted in the isolation key: the model snapshot, the tenant and
the request's cache_salt, so one tenant never hits another tenant's blocks and no
model reads another's. The hash is blake2b, not Python's `hash()` (which changes with
each process's hash seed): the same names outlive a restart and name the disk tier's
files (tokenmill/kv/disk.py). Only full blocks are shared; a hit is verified against
the stored token ids.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenmill.kv.block_pool import Block, BlockPool
from tokenmill.kv.pins import PinTable

if TYPE_CHECKING:
    from tokenmill.kv.tier import DiskTier, Restore


class CacheableRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    tenant: str | None
    cache_salt: str | None
    num_cached_tokens: int

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


def chain_root(model_key: bytes, tenant: str | None, cache_salt: str | None) -> bytes:
    """The parent of a request's first block: what isolates its chain (None and "" differ)."""
    h = hashlib.blake2b(digest_size=16, person=b"tokenmill-root")
    for part in (model_key, tenant, cache_salt):
        raw = b"\x00" if part is None else b"\x01" + (part if isinstance(part, bytes) else part.encode())
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.digest()


def block_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """A full block's name: its parent's name and its token ids (16 bytes, stable across processes)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=16).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 tier: DiskTier | None = None, pin_share_per_tenant: float = 0.25):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.tier = tier if enable_caching else None  # the disk tier under the prefix cache
        self.pool = BlockPool(num_blocks, on_evict=self._save_evicted if self.tier is not None else None)
        self.block_size = block_size
        self.enable_caching = enable_caching
        # the model snapshot's identity, the root of every chain (disk files outlive the model)
        self.model_key = self.tier.key if self.tier is not None else b""
        self._restores: dict[str, Restore] = {}  # request id -> its prefix being read from disk
        self.pins = PinTable(self.pool, pin_share_per_tenant)  # cache_control breakpoints' TTLs
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
    def isolation_key(self, req: CacheableRequest) -> bytes:
        return chain_root(self.model_key, req.tenant, req.cache_salt)

    def _block_tokens(self, req: CacheableRequest, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(req.token_slice(i * bs, (i + 1) * bs))

    def _chain(self, req: CacheableRequest, num_full_blocks: int) -> list[Hashable]:
        """The request's block hashes for its first num_full_blocks blocks, extended lazily.
        Token ids never change once known, so the chain survives preemption."""
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else self.isolation_key(req)
            for i in range(len(hashes), num_full_blocks):
                parent = block_hash(parent, self._block_tokens(req, i))
                hashes.append(parent)
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
        write = self.tier is not None and self.tier.write_through
        for i in range(start, n_full):
            toks = self._block_tokens(req, i)
            if self.pool.cache(blocks[i], hashes[i], toks) and write:
                self.tier.save(hashes[i], toks, blocks[i])
        self._num_published[rid] = n_full

    # -- the disk tier --------------------------------------------------------------------
    def _save_evicted(self, block: Block) -> None:
        self.tier.save(block.block_hash, block.token_ids, block.block_id)

    def start_restore(self, req: CacheableRequest) -> bool:
        """On a memory miss, begin reading back from disk the longest run of the request's
        next full blocks that is there, into freshly allocated blocks (its memory hits are
        held meanwhile). True: the request should wait (`restoring`) until it is done."""
        if self.tier is None or req.request_id in self._restores:
            return False
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hashes = self._chain(req, max_blocks)
        hits: list[int] = []
        for i, h in enumerate(hashes):
            bid = self.pool.lookup(h, self._block_tokens(req, i))
            if bid is None:
                break
            hits.append(bid)
        m = len(hits)
        self.tier.stats.lookup_tokens += (max_blocks - m) * bs
        n = 0
        while m + n < max_blocks and self.tier.has(hashes[m + n]):
            n += 1
        # room for the restored blocks and for computing the rest, hits taken off the free list
        room = (self.pool.num_free_blocks - sum(1 for b in hits if self.pool.blocks[b].ref_cnt == 0)
                - (self.blocks_needed(req.num_tokens) - m - n))
        n = min(n, room)
        if n <= 0:
            return False
        self.pool.touch(hits)
        blocks = self.pool.allocate(n)
        assert blocks is not None  # counted above
        self._restores[req.request_id] = self.tier.restore(
            req.request_id, hashes[m:m + n], [self._block_tokens(req, i) for i in range(m, m + n)], blocks, hits)
        return True

    def restoring(self, req: CacheableRequest) -> bool:
        """Whether the request waits for its prefix to be read from disk."""
        return req.request_id in self._restores

    @property
    def num_restoring(self) -> int:
        return len(self._restores)

    def tick(self, now: float) -> None:
        """Once a step: finished disk reads published, expired pins released."""
        self.poll_restores()
        self.pins.expire(now)

    # -- pins (cache_control) ---------------------------------------------------------------
    def pin_prefix(self, req: CacheableRequest, pins, now: float) -> dict[int, int]:
        """Pin the full blocks each of `pins` (engine.types.CachePin) covers, now that the
        request's prompt is computed and published. Returns the prompt tokens written to
        the cache under a pin, by TTL: blocks newly pinned that this request computed
        (blocks it read from the cache, or pinned already, are reads)."""
        if not self.enable_caching or not pins:
            return {}
        bs = self.block_size
        k_max = min(max(p.num_tokens for p in pins), req.num_computed_tokens) // bs
        blocks: list[tuple[bytes, int]] = []
        for i, h in enumerate(self._chain(req, k_max)):
            bid = self.pool.lookup(h, self._block_tokens(req, i))  # (the published copy)
            if bid is None:
                break
            blocks.append((h, bid))
        read = req.num_cached_tokens // bs
        writes: dict[int, int] = {}
        # the longest TTL first: a block two breakpoints cover is written once, at the longer
        for pin in sorted(pins, key=lambda p: -p.ttl_s):
            new = self.pins.pin(req.tenant, blocks[:pin.num_tokens // bs], pin.ttl_s, now)
            n = sum(1 for i, is_new in enumerate(new) if is_new and i >= read)
            if n:
                writes[pin.ttl_s] = writes.get(pin.ttl_s, 0) + n * bs
        return writes

    def poll_restores(self, timeout: float = 0.0) -> None:
        """Publish the blocks of finished restores in the prefix cache (the waiting request
        then hits them), waiting up to `timeout` seconds for one when none has finished."""
        if not self._restores:
            return
        done = self.tier.completed()
        if not done and timeout > 0:
            self.tier.wait(timeout)
            done = self.tier.completed()
        for r in done:
            if self._restores.get(r.request_id) is r:
                del self._restores[r.request_id]
            for i in range(r.num_loaded):
                # (if the same block was computed meanwhile, that copy stays the cached one)
                self.pool.cache(r.block_ids[i], r.keys[i], r.tokens[i])
            self.pool.free(reversed(r.pinned + r.block_ids))
            self.tier.stats.hit_tokens += r.num_loaded * self.block_size

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
        short = n_new + n_revived - self.pool.num_free_blocks
        if short > 0 and len(self.pins) and not any(self._blocks.get(r) for r in self._blocks if r != rid):
            self.pins.release(short)  # no one else holds blocks to free: pins must not block it for good
            short = n_new + n_revived - self.pool.num_free_blocks
        if short > 0:
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
        held = [r.pinned + r.block_ids for r in self._restores.values()] + [self.pins.pinned_blocks()]
        for blocks in [*self._blocks.values(), *held]:
            for b in blocks:
                refs[b] += 1
        for b in self.pool.blocks:
            assert refs[b.block_id] == b.ref_cnt, f"block {b.block_id}: {refs[b.block_id]} holders, ref {b.ref_cnt}"
