"""Property test: random add / step / abort sequences never leak or double-free a block."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import make_engine, tiny_loaded
from tokenmill.engine.api import SamplingParams

TINY = tiny_loaded(layers=1, hidden=16, heads=2, kv_heads=1)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 80), st.integers(1, 12), st.integers(1, 3),
                  st.integers(0, 5)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(8, 40), budget=st.integers(4, 64), caching=st.booleans())
def test_no_leak_no_double_free(ops, num_blocks, budget, caching):
    engine = make_engine(TINY, num_blocks=num_blocks, block_size=4, max_num_seqs=6,
                         max_num_batched_tokens=budget, prefix_caching=caching)
    added = []
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, n, prefix = op
            prompt = [5 + (i % 7) for i in range(prefix * 4)] + [10 + (i * 13) % 250 for i in range(plen)]
            rid = f"r{len(added)}"
            try:
                engine.add_request(rid, prompt, SamplingParams(
                    n=n, temperature=0.8, seed=len(added), max_tokens=max_tokens, ignore_eos=True))
                added.append(rid)
            except ValueError:
                pass  # can never fit this pool: refused at admission, which is allowed
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                engine.kv.check_integrity()
        elif added:
            engine.abort(added[op[1] % len(added)])
        engine.kv.check_integrity()
    guard = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
        guard += 1
        assert guard < 5000, "engine did not drain: a request is stuck"
    assert engine.kv.num_used_blocks == 0
    assert engine.kv.num_free_blocks == num_blocks
