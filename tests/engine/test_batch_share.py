"""The batch class beside interactive work: held to its share of each step while
interactive requests run, never starved, and giving up its KV blocks to them."""

from __future__ import annotations

import pytest

from tests.helpers import make_engine, run_to_completion, tiny_loaded
from tokenmill.engine.api import Priority, SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded()


def _prompt(n, offset=1):
    return [(offset + 7 * i) % 290 + 5 for i in range(n)]


def _record_steps(engine):
    """Each step's scheduled (request id, tokens), as the scheduler handed it to the runner."""
    steps: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append([(s.request_id, len(s.token_ids)) for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording
    return steps


def test_batch_share_bounds_batch_work_beside_interactive(tiny):
    engine = make_engine(tiny, max_num_seqs=8, max_num_batched_tokens=64, batch_share=0.25, decode_steps=1,
                         batch_step_tokens=24)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = {f"b{i}": (_prompt(30, i), sp) for i in range(6)}
    alone, _, _ = run_to_completion(make_engine(tiny), dict(batch))
    steps = _record_steps(engine)
    for rid, (ids, params) in batch.items():
        engine.add_request(rid, ids, params, priority=Priority.BATCH)
    outputs: dict[str, list[int]] = {}
    for o in engine.step():
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert sum(n for _, n in steps[-1]) == 24  # alone, batch steps are batch_step_tokens long
    live = 0
    totals = {"b": 0, "i": 0}
    while engine.has_unfinished():
        if not any(r.priority == Priority.INTERACTIVE for r in engine.scheduler.requests.values()):
            engine.add_request(f"i{live}", _prompt(20, 50 + live), SamplingParams(temperature=0, max_tokens=6))
            live += 1
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        step = steps[-1]
        for rid, n in step:
            totals[rid[0]] += n
        batch_part = sum(n for rid, n in step if rid.startswith("b"))
        assert batch_part <= engine.scheduler.config.batch_burst_tokens, step
        # at most the share of interactive tokens so far (and one burst of credit)
        assert totals["b"] <= 0.25 * totals["i"] + 4
    assert live > 10  # interactive requests kept coming, and the batch still finished
    assert totals["b"] >= 0.15 * totals["i"]  # most of its share (credit beyond one burst is dropped)
    for rid in batch:  # held back, preempted or not, the answer is the same
        assert outputs[rid] == alone[rid][0]
    engine.kv.check_integrity()


def test_waiting_interactive_takes_blocks_from_batch(tiny):
    # 12 blocks of 16 tokens: after 20 steps, three batch requests of 40 + 20 tokens hold all of them
    engine = make_engine(tiny, num_blocks=12, max_num_seqs=8, decode_steps=1)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"b{i}", _prompt(40, i), sp, priority=Priority.BATCH)
    for _ in range(20):
        engine.step()
    assert engine.kv.num_free_blocks <= 1
    engine.add_request("i0", _prompt(40, 77), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    assert "i0" in [r.request_id for r in engine.scheduler.running]
    assert engine.scheduler.num_preemptions >= 1
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished[0] == "i0" and sorted(finished) == ["b0", "b1", "b2", "i0"]
    engine.kv.check_integrity()
