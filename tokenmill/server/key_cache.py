"""The server's view of the key store: lookups off the event loop, a short-lived cache,
and a bounded wait on a database another process has locked.

SQLite waits on a lock up to its busy timeout inside the calling thread; read on the
event loop, one `BEGIN EXCLUSIVE` in an operator's shell (or a backup) stalled every
request for 5 s and then answered 500. So every read here runs in one worker thread
whose connection waits at most `BUSY_S`, then raises `StoreBusy` (503 `store_busy`,
Retry-After: 1); while a lookup has just found the database locked, the next ones within
`BUSY_S` answer `StoreBusy` at once instead of queueing behind it. /health, /ready and
/metrics read no keys and are never held.

A key that was verified within `ttl_s` is served from memory, so requests go on while
the database is locked. The price: a revoked key, or a tenant's changed limits, take
effect within `ttl_s` (default 5 s; `serve --keys-cache-ttl 0` reads the database for
every request). Usage and limits are kept per tenant name by the gate, so a cached
`Tenant` and a fresh one account to the same tenant; a cached one carries the limits it
was read with until its entry expires. Unknown keys are not cached (a flood of random
keys would only fill memory): each is one indexed read in the worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenmill.batch.storage import StoreBusy, storage_error
from tokenmill.server.keys import KeyStore, Tenant, hash_key

log = logging.getLogger("tokenmill.server")
T = TypeVar("T")

BUSY_S = 1.0  # how long a key lookup waits on another process's lock before 503
MAX_ENTRIES = 4096  # verified keys (and tenant names) kept; the oldest go first past it


class KeyCache:
    def __init__(self, store: KeyStore, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if ttl_s < 0:
            raise ValueError("the key cache's TTL cannot be negative")
        self.store = store
        self.ttl_s = ttl_s
        store.set_busy_timeout(BUSY_S)
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-keys")  # one connection
        self._by_key: dict[str, tuple[float, Tenant]] = {}  # key hash -> (expires, tenant)
        self._by_name: dict[str, tuple[float, Tenant | None]] = {}  # tenant name -> (expires, tenant)
        self._pending: dict[tuple[str, str], asyncio.Future] = {}  # lookups under way, shared by their askers
        self._locked_at: float | None = None  # (worker thread) when a read last found the database locked

    async def authenticate(self, key: str) -> Tenant | None:
        """The key's tenant, None for an unknown or revoked key; StoreBusy when the database
        is locked and the key was not verified within the TTL."""
        h = hash_key(key)
        hit = self._fresh(self._by_key, h)
        if hit is not None:
            return hit[1]
        tenant = await self._shared(("key", h), self.store.authenticate, key)
        if tenant is not None and self.ttl_s > 0:
            self._put(self._by_key, h, tenant)
            self._put(self._by_name, tenant.name, tenant)
        return tenant

    async def tenant(self, name: str) -> Tenant | None:
        """A tenant by name (the Batch API's lines run as the tenant that submitted them)."""
        hit = self._fresh(self._by_name, name)
        if hit is not None:
            return hit[1]
        tenant = await self._shared(("name", name), self.store.tenant, name)
        if self.ttl_s > 0:
            self._put(self._by_name, name, tenant)
        return tenant

    async def tenants(self) -> list[Tenant]:
        """Every tenant, read afresh (the admin's stats)."""
        return await self._shared(("all", ""), self.store.tenants)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ------------------------------------------------------------------------
    def _fresh(self, table: dict, k: str) -> tuple | None:
        entry = table.get(k)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del table[k]
            return None
        return entry

    def _put(self, table: dict, k: str, value) -> None:
        table.pop(k, None)
        if len(table) >= MAX_ENTRIES:
            now = self._clock()
            for old in [x for x, (expires, _) in table.items() if expires <= now]:
                del table[old]
            while len(table) >= MAX_ENTRIES:
                del table[next(iter(table))]  # the oldest entry (dicts keep insertion order)
        table[k] = (self._clock() + self.ttl_s, value)

    async def _shared(self, what: tuple[str, str], fn: Callable[..., T], *args) -> T:
        """Run `fn` in the worker thread once for all concurrent askers of the same thing;
        a cancelled asker does not cancel the others' read."""
        fut = self._pending.get(what)
        if fut is None:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._read, fn, *args)
            self._pending[what] = fut
            fut.add_done_callback(lambda f: self._done(what, f))
        return await asyncio.shield(fut)

    def _done(self, what: tuple[str, str], fut: asyncio.Future) -> None:
        self._pending.pop(what, None)
        if not fut.cancelled():
            fut.exception()  # retrieved: every asker may have gone away

    def _read(self, fn: Callable[..., T], *args) -> T:
        """(Worker thread.) One read, StoreBusy for a locked or unreadable database."""
        if self._locked_at is not None and time.monotonic() - self._locked_at < BUSY_S:
            raise StoreBusy("the API keys database is locked by another process; retry shortly")
        try:
            out = fn(*args)
        except sqlite3.DatabaseError as exc:  # locked, or corrupt or not a database: refused, not a 500
            err = storage_error(exc, "the API keys store")
            if isinstance(err, StoreBusy):
                self._locked_at = time.monotonic()
                raise err from None
            log.error("the API keys database cannot be read: %s", exc)
            raise StoreBusy(f"the API keys database cannot be read ({exc})") from None
        self._locked_at = None
        return out
