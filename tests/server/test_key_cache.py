"""The key store as the server reads it (tokenmill/server/key_cache.py), no model: another
process holding the keys file's exclusive lock costs a lookup at most about BUSY_S (then
StoreBusy) and never stalls the event loop; keys verified within the TTL go on being
served; revocation and changed limits take effect once the TTL has passed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from tokenmill.batch.storage import StoreBusy
from tokenmill.server.key_cache import BUSY_S, KeyCache
from tokenmill.server.keys import KeyStore, TenantLimits

_HOLD = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # held until the test closes our stdin
db.execute("ROLLBACK")
"""


class _Lock:
    """Another process holding `BEGIN EXCLUSIVE` on the file (as an operator's shell may)."""

    def __init__(self, path):
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> "_Lock":
        assert self.proc.stdout.readline().strip() == "locked"
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _lagging(coro) -> tuple[object, float, float]:
    """Run `coro`, sampling the event loop's lag meanwhile: (its result or exception, seconds, max lag)."""
    loop = asyncio.get_running_loop()
    lag = 0.0
    done = False

    async def probe() -> None:
        nonlocal lag
        while not done:
            t = loop.time()
            await asyncio.sleep(0.01)
            lag = max(lag, loop.time() - t - 0.01)

    task = asyncio.create_task(probe())
    t0 = time.monotonic()
    try:
        out = await coro
    except Exception as exc:
        out = exc
    took = time.monotonic() - t0
    done = True
    await task
    return out, took, lag


def test_a_locked_key_store_answers_busy_fast_and_serves_verified_keys(tmp_path):
    db = tmp_path / "keys.db"
    admin = KeyStore(db)
    seen, unseen = admin.add_key("alice"), admin.add_key("bob")
    admin.close()
    cache = KeyCache(KeyStore(db), ttl_s=5.0, clock=(clock := _Clock()))

    async def run() -> None:
        assert (await cache.authenticate(seen)).name == "alice"
        with _Lock(db):
            tenant, took, _ = await _lagging(cache.authenticate(seen))  # verified within the TTL
            assert tenant.name == "alice" and took < 0.1, took
            err, took, lag = await _lagging(cache.authenticate(unseen))
            assert isinstance(err, StoreBusy), err
            assert BUSY_S * 0.8 < took < BUSY_S + 1.0, took  # sqlite3's own 5 s wait, and the loop with it, before
            assert lag < 0.25, lag  # the wait was in the worker thread
            err, took, _ = await _lagging(cache.authenticate(unseen))  # found locked just now: at once
            assert isinstance(err, StoreBusy) and took < 0.2, (err, took)
            clock.now += 6  # past the TTL the verified key needs the file too
            err, _, _ = await _lagging(cache.authenticate(seen))
            assert isinstance(err, StoreBusy), err
            many = await asyncio.gather(*(cache.authenticate(unseen) for _ in range(20)), return_exceptions=True)
            assert all(isinstance(e, StoreBusy) for e in many)
        await asyncio.sleep(BUSY_S)  # (the last lookup found it locked: the next is refused within BUSY_S)
        assert (await cache.authenticate(unseen)).name == "bob"
        assert (await cache.authenticate(seen)).name == "alice"
        assert await cache.authenticate("tm-not-a-key") is None

    asyncio.run(run())
    cache.close()


def test_revocation_and_new_limits_take_effect_within_the_ttl(tmp_path):
    db = tmp_path / "keys.db"
    admin = KeyStore(db)
    key = admin.add_key("alice", TenantLimits(rpm=10))
    cache = KeyCache(KeyStore(db), ttl_s=5.0, clock=(clock := _Clock()))
    uncached = KeyCache(KeyStore(db), ttl_s=0)

    async def run() -> None:
        assert (await cache.authenticate(key)).limits.rpm == 10
        assert (await cache.tenant("alice")).limits.rpm == 10
        admin.add_key("alice", TenantLimits(rpm=20))
        clock.now += 4  # within the TTL: the tenant as it was read
        assert (await cache.authenticate(key)).limits.rpm == 10
        assert (await uncached.authenticate(key)).limits.rpm == 20  # TTL 0: every lookup reads the file
        clock.now += 2
        assert (await cache.authenticate(key)).limits.rpm == 20
        assert (await cache.tenant("alice")).limits.rpm == 20
        assert admin.revoke(key=key) == 1
        assert await uncached.authenticate(key) is None
        clock.now += 4
        assert await cache.authenticate(key) is not None  # the documented window
        clock.now += 2
        assert await cache.authenticate(key) is None

    asyncio.run(run())
    for c in (cache, uncached):
        c.close()
    admin.close()


def test_the_ttl_cannot_be_negative(tmp_path):
    with pytest.raises(ValueError):
        KeyCache(KeyStore(tmp_path / "keys.db"), ttl_s=-1)
