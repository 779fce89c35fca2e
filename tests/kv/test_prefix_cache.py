"""Automatic prefix caching: same outputs, real savings, safe eviction, tenant isolation."""

from __future__ import annotations

import pytest

from tests.helpers import make_engine, run_to_completion, tiny_loaded
from tokenmill.engine.api import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded(max_pos=2048)


def _ids(n, seed):
    return [(seed * 31 + i * 17) % 280 + 10 for i in range(n)]


def _workload():
    system = _ids(120, 1)
    reqs = {}
    for i in range(8):
        reqs[f"g{i}"] = (system + _ids(5 + 3 * i, 100 + i), SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True))
        reqs[f"s{i}"] = (system + _ids(9 + i, 200 + i), SamplingParams(
            temperature=0.9, top_p=0.95, seed=i, max_tokens=12, ignore_eos=True))
    return reqs


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_outputs_identical_with_caching_on_and_off(tiny, max_num_seqs):
    off, _, _ = run_to_completion(make_engine(tiny, prefix_caching=False, max_num_seqs=max_num_seqs), _workload())
    engine = make_engine(tiny, prefix_caching=True, max_num_seqs=max_num_seqs)
    on, _, _ = run_to_completion(engine, _workload())
    assert on == off
    assert engine.kv.stats.hits > 0


def test_shared_1000_token_prefix_is_served_from_cache(tiny):
    engine = make_engine(tiny, num_blocks=256, max_num_batched_tokens=2048)
    prefix = _ids(1000, 7)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    run_to_completion(engine, {"first": (prefix + _ids(30, 8), sp)})
    before = engine.prompt_tokens_computed
    engine.add_request("second", prefix + _ids(40, 9), sp)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    cached = outs[0].num_cached_tokens
    assert cached == (1000 // 16) * 16 == 992
    assert engine.prompt_tokens_computed - before == 1040 - 992


def test_eviction_under_memory_pressure(tiny):
    reqs = {}
    for i in range(40):
        reqs[f"r{i}"] = (_ids(40 + i % 5, 1000 + i), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        if i % 8 == 3:  # soon after: a hit; long after (the last one): evicted by then
            reqs[f"again{i}"] = reqs[f"r{i - 2}"]
    reqs["again-first"] = reqs["r0"]
    ref, _, _ = run_to_completion(make_engine(tiny, prefix_caching=False, num_blocks=16), dict(reqs))
    engine = make_engine(tiny, prefix_caching=True, num_blocks=16, max_num_seqs=3)
    got, _, _ = run_to_completion(engine, dict(reqs), check=lambda e: e.kv.check_integrity())
    assert got == ref
    assert engine.kv.pool.num_evictions > 0
    st = engine.kv.stats
    assert st.requests == len(reqs) and 0 < st.hit_rate < 1
    assert engine.kv.num_used_blocks == 0


def _cached_tokens(engine, rid, ids, **kw):
    engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), **kw)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs[0].num_cached_tokens


def test_tenants_are_isolated(tiny):
    engine = make_engine(tiny)
    prompt = _ids(100, 3)
    assert _cached_tokens(engine, "a1", prompt, tenant="alice") == 0
    assert _cached_tokens(engine, "b1", prompt, tenant="bob") == 0  # no cross-tenant hit
    assert _cached_tokens(engine, "a2", prompt, tenant="alice") == 96
    assert _cached_tokens(engine, "b2", prompt, tenant="bob") == 96
    assert _cached_tokens(engine, "a3", prompt, tenant="alice", cache_salt="s1") == 0
    assert _cached_tokens(engine, "a4", prompt, tenant="alice", cache_salt="s1") == 96


def test_caching_off_reports_no_hits(tiny):
    engine = make_engine(tiny, prefix_caching=False)
    prompt = _ids(100, 3)
    assert _cached_tokens(engine, "a", prompt) == 0
    assert _cached_tokens(engine, "b", prompt) == 0
    assert engine.kv.pool.num_cached_blocks == 0
