"""The scheduler alone: built from factories over ints and ids, no model and no torch,
each test milliseconds. The model-backed tests (test_engine.py, test_batching.py...)
check the same rules end to end."""

from __future__ import annotations

import subprocess
import sys

from tokenmill.config import SchedulerConfig, SpeculativeConfig
from tokenmill.engine.api import RequestLimits
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.types import Priority, SamplingParams
from tokenmill.kv.manager import KVCacheManager

VOCAB = 1000
EOS = 999


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, decode_steps: int = 1, prefix_caching: bool = True,
                   **config) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=512, decode_steps=decode_steps, **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, prefix_caching))


def make_requests(rid: str, prompt: list[int], n: int = 1, priority: int = Priority.INTERACTIVE,
                  tenant: str | None = None, **params) -> list[Request]:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    resolved = RequestLimits(512, 4096, VOCAB).resolve([prompt], SamplingParams(n=n, **params))
    return [Request(rid if n == 1 else f"{rid}#{i}", prompt, resolved, group_id=rid, index=i, priority=priority,
                    tenant=tenant, eos_token_ids=(EOS,)) for i in range(n)]


def add(s: Scheduler, *args, **kwargs) -> list[Request]:
    reqs = make_requests(*args, **kwargs)
    s.add_requests(reqs)
    return reqs


def step(s: Scheduler, token: int = 7, tokens: dict[str, list[int]] | None = None):
    """One step as the engine runs it: schedule, then each sampling row gets `token`
    (num_steps of them for a burst), or what `tokens` gives for its request."""
    out = s.schedule()
    sampled = {sr.request_id: (tokens or {}).get(sr.request_id, [token] * out.num_steps)
               for sr in out.scheduled if sr.sample}
    s.update(out, sampled)
    s.kv.check_integrity()
    return out


def test_the_scheduler_imports_no_torch():
    code = ("import sys, tokenmill.engine.scheduler, tokenmill.engine.step_budget\n"
            "assert 'torch' not in sys.modules, 'the scheduler pulled in torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_then_decode():
    s = make_scheduler(max_num_batched_tokens=16)
    [r] = add(s, "a", list(range(1, 41)))
    sizes = [len(step(s).scheduled[0].token_ids) for _ in range(4)]
    assert sizes == [16, 16, 8, 1]
    assert r.num_output_tokens == 2 and r.num_computed_tokens == 41


def test_decodes_go_first_and_a_long_prompt_never_stalls_them():
    s = make_scheduler(max_num_batched_tokens=8)
    [a] = add(s, "a", [1, 2, 3])
    step(s)
    add(s, "b", list(range(1, 30)))
    out = step(s)
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    assert [len(sr.token_ids) for sr in out.scheduled] == [1, 7]
    assert out.num_scheduled_tokens <= 8


def test_a_prefix_hit_computes_only_the_rest():
    s = make_scheduler()
    prompt = list(range(1, 18))  # 4 full blocks of 4 and one token
    add(s, "a", prompt, max_tokens=1)
    step(s)
    assert "a" not in s.requests  # finished: its full blocks stay cached
    [b] = add(s, "b", prompt + [50, 51], max_tokens=1)
    out = step(s)
    assert b.num_cached_tokens == 16 and out.scheduled[0].start == 16
    assert out.scheduled[0].token_ids == [17, 50, 51]
    s.kv.check_integrity()


def test_preemption_takes_the_newest_of_the_lowest_class_and_it_resumes():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    [b] = add(s, "b", list(range(20, 28)), max_tokens=12, ignore_eos=True, priority=Priority.BATCH)
    step(s)  # batch work alone runs (2 blocks)
    [a] = add(s, "a", list(range(1, 9)), max_tokens=12, ignore_eos=True)
    [c] = add(s, "c", list(range(40, 48)), max_tokens=12, ignore_eos=True)
    preempted = []
    for _ in range(60):
        preempted += step(s).preempted_ids
        if not s.has_unfinished():
            break
    # 6 blocks hold two of the three at 20 tokens: the batch request gives way first,
    # then the newer interactive one; every request still completes
    assert preempted[0] == "b" and "a" not in preempted
    assert b.num_preemptions >= 1 and all(r.finished and r.num_output_tokens == 12 for r in (a, b, c))


def test_tenants_take_turns_for_slots():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(s, f"flood{i}", [1, 2, 3], tenant="flood", max_tokens=20, ignore_eos=True)
    add(s, "other", [4, 5, 6], tenant="other", max_tokens=20, ignore_eos=True)
    out = step(s)
    assert sorted(sr.request_id for sr in out.scheduled) == ["flood0", "other"]


def test_interactive_work_takes_a_batch_request_slot():
    s = make_scheduler(max_num_seqs=1)
    [b] = add(s, "b", [1, 2, 3], priority=Priority.BATCH, max_tokens=50, ignore_eos=True)
    step(s)
    add(s, "i", [4, 5, 6], max_tokens=3)
    out = step(s)
    assert out.preempted_ids == ["b"] and [sr.request_id for sr in out.scheduled] == ["i"]
    assert b.status == RequestStatus.PREEMPTED or b.status == RequestStatus.WAITING


def test_batch_work_gets_its_share_beside_live_work_and_short_steps_alone():
    s = make_scheduler(max_num_batched_tokens=64, batch_share=0.25, batch_burst_tokens=4, batch_step_tokens=8)
    add(s, "b", list(range(1, 41)), priority=Priority.BATCH, max_tokens=4)
    out = step(s)
    assert out.num_scheduled_tokens == 8  # alone: a short step
    add(s, "i", list(range(100, 140)), max_tokens=30, ignore_eos=True)
    batch_tokens = []
    for _ in range(6):
        out = step(s)
        batch_tokens.append(sum(len(sr.token_ids) for sr in out.scheduled if sr.request_id == "b"))
        assert out.num_scheduled_tokens <= 64
    # credit is earned at a quarter of the interactive tokens, spent at most 4 a step
    assert max(batch_tokens) <= 4 and sum(batch_tokens) >= 1


def test_the_step_budget_is_never_exceeded():
    s = make_scheduler(max_num_batched_tokens=20, max_num_seqs=16)
    for i in range(10):
        add(s, f"r{i}", list(range(1, 3 + 5 * i)), max_tokens=6)
    for _ in range(40):
        out = step(s)
        assert out.num_scheduled_tokens <= 20
        assert sum(len(sr.token_ids) for sr in out.scheduled) == out.num_scheduled_tokens
    assert not s.has_unfinished()


def test_n_samples_fork_the_prompt_blocks():
    s = make_scheduler()
    reqs = add(s, "g", list(range(1, 14)), n=3, max_tokens=5)  # 3 full blocks + 1
    leader = reqs[0]
    step(s)  # the leader prefills; the others wait for its blocks
    assert leader.num_computed_tokens == 13 and all(r.num_computed_tokens == 0 for r in reqs[1:])
    step(s)
    blocks = [s.kv.blocks_of(r.request_id) for r in reqs]
    assert blocks[1][:3] == blocks[0][:3] == blocks[2][:3]  # shared, not copied
    assert len({b[3] for b in blocks}) == 3  # each its own last block


def test_a_burst_runs_several_steps_for_plain_decodes():
    s = make_scheduler(decode_steps=8)
    [a] = add(s, "a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    step(s)
    out = step(s)
    assert out.num_steps == 8 and a.num_output_tokens == 9
    [b] = add(s, "b", [4, 5, 6], max_tokens=20, logprobs=1)
    step(s)  # admits b: no burst
    out = step(s)
    assert out.num_steps == 1  # b wants logprobs


def test_rejected_drafts_are_rolled_back():
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    s = make_scheduler(speculative=spec)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]  # "5 6 7" repeats: the next tokens look like "8 9 5"
    [r] = add(s, "r", prompt, max_tokens=20, ignore_eos=True)
    step(s, token=8)  # prefill; the output so far: [8]
    drafts = []
    for _ in range(4):
        out = s.schedule()
        [sr] = out.scheduled
        drafts.append(sr.draft_token_ids)
        before = r.num_computed_tokens
        # the model accepts the first draft only, then says 1
        made = sr.draft_token_ids[:1] + [1] if sr.draft_token_ids else [1]
        s.update(out, {"r": made})
        assert r.num_computed_tokens == before + len(made)  # only accepted rows count
        assert r.num_tokens - r.num_computed_tokens == 1
        s.kv.check_integrity()
    assert any(drafts), "the repeated n-gram should have drafted"
    assert r.num_draft_tokens >= 1 and r.num_accepted_tokens <= r.num_draft_tokens


def test_a_stop_found_in_text_drops_the_tokens_after_it():
    s = make_scheduler(decode_steps=4)
    [r] = add(s, "r", [1, 2, 3], max_tokens=20, ignore_eos=True)
    step(s)
    step(s)  # a burst of 4
    assert r.num_output_tokens == 5
    s.stop(r, 3, "stop!")
    assert r.finished and r.num_output_tokens == 3 and r.stop_reason == "stop!"
    assert r.finish_reason == "stop" and "r" not in s.requests
    s.kv.check_integrity()
