"""cache_control breakpoints in the engine: a pinned prefix stays cached under memory
pressure until its TTL, then is evictable; writes and reads are counted by TTL; a tenant
pins at most its share; pins never keep a request from running."""

from __future__ import annotations

import time

import pytest

from tests.helpers import tiny_loaded
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.api import CachePin, InvalidParameter, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

FIVE_MIN, HOUR = 300, 3600


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded(max_pos=2048)


def _ids(n, seed):
    return [(seed * 31 + i * 17) % 280 + 10 for i in range(n)]


PREFIX = _ids(320, 1)  # 20 blocks


def engine(loaded, share=0.4, num_blocks=64):
    cache = CacheConfig(num_blocks=num_blocks, pin_share_per_tenant=share)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=1024)))


def run(e, ids, pins=(), tenant="t", rid=None):
    """(cached prompt tokens, cache writes by TTL) of one request."""
    rid = rid or f"r{time.monotonic_ns()}"
    e.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_pins=pins),
                  tenant=tenant)
    last = None
    while e.has_unfinished():
        for out in e.step():
            last = out
    e.kv.check_integrity()
    return last.num_cached_tokens, last.cache_write_tokens


def pressure(e):
    """Prompts that together need more than the pool: every unpinned cached block goes."""
    for i in range(3):
        run(e, _ids(700, 50 + i), tenant="other")


def test_a_pinned_prefix_outlives_pressure_until_its_ttl(tiny):
    e = engine(tiny)
    assert run(e, PREFIX + _ids(7, 2), (CachePin(320, FIVE_MIN),)) == (0, {FIVE_MIN: 320})
    pressure(e)
    # a read: the pin's deadline moves out, nothing is written
    assert run(e, PREFIX + _ids(9, 3), (CachePin(320, FIVE_MIN),)) == (320, {})
    assert run(e, PREFIX + _ids(9, 4)) == (320, {})  # any request reads it meanwhile
    e.kv.tick(time.monotonic() + FIVE_MIN + 1)  # past its TTL: an ordinary cached block
    pressure(e)
    assert run(e, PREFIX + _ids(9, 5)) == (0, {})
    assert len(e.kv.pins) == 0


def test_without_a_pin_pressure_evicts_it(tiny):
    e = engine(tiny)
    assert run(e, PREFIX + _ids(7, 2)) == (0, {})
    pressure(e)
    assert run(e, PREFIX + _ids(9, 3))[0] == 0


def test_writes_are_counted_by_ttl(tiny):
    e = engine(tiny, num_blocks=128)
    pins = (CachePin(160, HOUR), CachePin(320, FIVE_MIN))
    assert run(e, PREFIX + _ids(7, 2), pins) == (0, {HOUR: 160, FIVE_MIN: 160})
    # half of a longer breakpoint already cached: only its new blocks are written
    assert run(e, PREFIX + _ids(160, 6) + [1], (CachePin(480, HOUR),)) == (320, {HOUR: 160})


def test_another_tenant_neither_reads_nor_refreshes_it(tiny):
    e = engine(tiny, num_blocks=128)
    run(e, PREFIX + [1], (CachePin(320, FIVE_MIN),), tenant="a")
    assert run(e, PREFIX + [2], (CachePin(320, FIVE_MIN),), tenant="b") == (0, {FIVE_MIN: 320})


def test_a_tenant_pins_at_most_its_share(tiny):
    e = engine(tiny, share=0.25)  # 16 of 64 blocks
    assert run(e, _ids(400, 8) + [1], (CachePin(400, HOUR),)) == (0, {HOUR: 256})
    assert e.kv.pins.num_refused == 25 - 16
    assert run(e, _ids(300, 9) + [1], (CachePin(300, HOUR),)) == (0, {})  # its share is full


def test_pins_never_keep_a_request_from_running(tiny):
    e = engine(tiny, share=0.5)  # 32 blocks pinned
    run(e, _ids(520, 8) + [1], (CachePin(512, HOUR),))
    assert len(e.kv.pins) == 32
    cached, _ = run(e, _ids(900, 10), tenant="other")  # needs 57 of 64 blocks
    assert cached == 0 and len(e.kv.pins) < 32


def test_breakpoints_are_checked(tiny):
    e = engine(tiny)
    sp = SamplingParams(max_tokens=2, cache_pins=tuple(CachePin(16 * i, FIVE_MIN) for i in range(1, 6)))
    with pytest.raises(InvalidParameter, match="at most 4"):
        e.add_request("x", PREFIX, sp)
    with pytest.raises(InvalidParameter, match="ttl"):
        e.add_request("x", PREFIX, SamplingParams(max_tokens=2, cache_pins=(CachePin(16, 600),)))
    with pytest.raises(InvalidParameter, match="past the end"):
        e.add_request("x", PREFIX, SamplingParams(max_tokens=2, cache_pins=(CachePin(321, 300),)))
