"""Prompt prefixes kept cached until a deadline (cache_control breakpoints with a TTL).

A pinned block holds one reference in the block pool, so memory pressure never evicts
it; when its deadline passes, the reference is dropped and the block is an ordinary
cached block again (evictable, LRU). Using a pinned prefix again with a breakpoint
pushes its deadline out. Each tenant may pin at most its share of the pool, and all
tenants together at most half of it, so pins never starve live requests; a request
that cannot run at all while pins hold blocks takes them (`release`) rather than wait.
Pure Python, like the block pool.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from tokenmill.kv.block_pool import BlockPool


@dataclass
class _Pin:
    block_id: int
    tenant: str | None
    expires: float  # time.monotonic()


class PinTable:
    def __init__(self, pool: BlockPool, share_per_tenant: float):
        self.pool = pool
        self.max_blocks = pool.num_blocks // 2
        self.max_per_tenant = min(self.max_blocks, int(pool.num_blocks * share_per_tenant))
        self._pins: dict[bytes, _Pin] = {}  # block hash -> its pin
        self._heap: list[tuple[float, bytes]] = []  # (deadline, hash); stale entries skipped
        self._per_tenant: dict[str | None, int] = {}
        self.num_refused = 0  # blocks not pinned: the tenant's share or the pool's half was full

    def __len__(self) -> int:
        return len(self._pins)

    def pinned_blocks(self) -> list[int]:
        return [p.block_id for p in self._pins.values()]

    def pin(self, tenant: str | None, blocks: list[tuple[bytes, int]], ttl_s: float, now: float) -> list[bool]:
        """Pin (block hash, block id) pairs, a prefix in order, until now + ttl_s, or push a
        pin's deadline out. Returns, for each block pinned, whether it is a new pin; the
        list stops short where the tenant's share (or the pool's half) is full."""
        out = []
        expires = now + ttl_s
        for h, bid in blocks:
            p = self._pins.get(h)
            if p is None:
                held = self._per_tenant.get(tenant, 0)
                if held >= self.max_per_tenant or len(self._pins) >= self.max_blocks:
                    self.num_refused += len(blocks) - len(out)
                    break
                self.pool.touch([bid])
                self._pins[h] = _Pin(bid, tenant, expires)
                self._per_tenant[tenant] = held + 1
                heapq.heappush(self._heap, (expires, h))
                out.append(True)
            else:
                if expires > p.expires:
                    p.expires = expires
                    heapq.heappush(self._heap, (expires, h))
                out.append(False)
        return out

    def expire(self, now: float) -> None:
        """Unpin every block whose deadline has passed."""
        while self._heap and self._heap[0][0] <= now:
            _, h = heapq.heappop(self._heap)
            p = self._pins.get(h)
            if p is not None and p.expires <= now:
                self._drop(h, p)

    def release(self, n: int) -> int:
        """Unpin up to n blocks, the nearest deadlines first; returns how many."""
        done = 0
        for h, p in sorted(self._pins.items(), key=lambda kv: kv[1].expires)[:n]:
            self._drop(h, p)
            done += 1
        return done

    def _drop(self, h: bytes, p: _Pin) -> None:
        del self._pins[h]
        self._per_tenant[p.tenant] -= 1
        if not self._per_tenant[p.tenant]:
            del self._per_tenant[p.tenant]
        self.pool.free([p.block_id])
