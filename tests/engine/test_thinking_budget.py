"""Thinking budgets in the scheduler alone (torch-free, the factories of test_scheduler):
the reasoning tokens counted (tags included), the closing tag forced when the budget is
spent, bursts and speculative drafts cut short of it, a reply that never opens a block."""

from __future__ import annotations

import pytest

from tests.engine.test_scheduler import make_requests, make_scheduler
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.api import InvalidParameter
from tokenmill.engine.types import ThinkingTags

OPEN = (50, 51)  # a two-token "<think>"
CLOSE = (60, 61, 62)  # a three-token "</think>"
WORD = 7  # what the scripted model says when it is free


def run(s, reqs, steps=60, model=None):
    """Run until done: each sampling row gets its forced token, else what `model` says
    (given the request's output so far and how many tokens this step makes), else WORD."""
    s.add_requests(reqs)
    outs = []
    for _ in range(steps):
        if not s.has_unfinished():
            break
        out = s.schedule()
        outs.append(out)
        sampled = {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            k = out.num_steps + len(sr.draft_token_ids)
            if sr.forced_token_id is not None:
                assert k == 1, "a forced token is sampled alone"
                sampled[sr.request_id] = [sr.forced_token_id]
            else:
                made = model(sr) if model else [WORD] * k
                sampled[sr.request_id] = made[:k]
        s.update(out, sampled)
        s.kv.check_integrity()
    return outs


@pytest.mark.parametrize("budget", [3, 4, 9, 20])
def test_the_budget_closes_the_block_inside(budget):
    s = make_scheduler()
    tags = ThinkingTags(OPEN, CLOSE, inside=True)
    [r] = make_requests("r", [1, 2, 3], max_tokens=40, ignore_eos=True, thinking=tags,
                        thinking_token_budget=budget)
    run(s, [r])
    out = r.output_token_ids
    assert tuple(out[budget - 3:budget]) == CLOSE  # the closing tag ends the budget exactly
    assert r.num_reasoning_tokens == budget
    assert out[budget:] == [WORD] * (40 - budget)  # then the answer, free


def test_the_reply_opens_the_block_and_the_budget_counts_the_tags():
    s = make_scheduler()
    [r] = make_requests("r", [1, 2], max_tokens=20, ignore_eos=True,
                        thinking=ThinkingTags(OPEN, CLOSE), thinking_token_budget=8)
    # the model opens with the first tag token; the rest of the tag is forced
    run(s, [r], model=lambda sr: [OPEN[0]] if not sr.output_token_ids else [WORD] * 16)
    out = r.output_token_ids
    assert tuple(out[:2]) == OPEN and tuple(out[5:8]) == CLOSE and out[2:5] == [WORD] * 3
    assert r.num_reasoning_tokens == 8


def test_a_reply_that_does_not_open_has_no_reasoning():
    s = make_scheduler()
    [r] = make_requests("r", [1, 2], max_tokens=12, ignore_eos=True,
                        thinking=ThinkingTags(OPEN, CLOSE), thinking_token_budget=5)
    run(s, [r])
    assert r.output_token_ids == [WORD] * 12 and r.num_reasoning_tokens == 0


def test_the_model_closing_on_its_own_ends_the_count():
    s = make_scheduler()
    script = [WORD, WORD, *CLOSE, 9, 9, 9]
    [r] = make_requests("r", [1, 2], max_tokens=8, ignore_eos=True,
                        thinking=ThinkingTags(OPEN, CLOSE, always=True), thinking_token_budget=100)
    run(s, [r], model=lambda sr: script[len(sr.output_token_ids):])
    assert r.output_token_ids == script and r.num_reasoning_tokens == 5


def test_no_budget_counts_without_forcing():
    s = make_scheduler()
    [r] = make_requests("r", [1, 2], max_tokens=10, ignore_eos=True, thinking=ThinkingTags(OPEN, CLOSE, inside=True))
    run(s, [r])
    assert r.output_token_ids == [WORD] * 10 and r.num_reasoning_tokens == 10  # it never closed


def test_bursts_stop_short_of_the_forced_tag():
    s = make_scheduler(decode_steps=8)
    [r] = make_requests("r", [1, 2, 3], max_tokens=30, ignore_eos=True,
                        thinking=ThinkingTags(OPEN, CLOSE, inside=True), thinking_token_budget=12)
    outs = run(s, [r])
    assert any(o.num_steps > 1 for o in outs), "bursts should still run while thinking"
    out = r.output_token_ids
    assert tuple(out[9:12]) == CLOSE and r.num_reasoning_tokens == 12
    assert out[12:] == [WORD] * 18


def test_drafts_stop_short_of_the_forced_tag():
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    s = make_scheduler(speculative=spec)
    # the prompt is all WORD: the n-gram drafter proposes WORD again and again
    [r] = make_requests("r", [WORD] * 8, max_tokens=24, ignore_eos=True,
                        thinking=ThinkingTags(OPEN, CLOSE, inside=True), thinking_token_budget=10)
    outs = run(s, [r])
    drafted = [len(sr.draft_token_ids) for o in outs for sr in o.scheduled]
    assert max(drafted) > 0, "the drafter should have drafted"
    out = r.output_token_ids
    assert tuple(out[7:10]) == CLOSE and r.num_reasoning_tokens == 10


def test_a_stop_string_cut_recounts():
    s = make_scheduler()
    [r] = make_requests("r", [1, 2], max_tokens=10, ignore_eos=True, thinking=ThinkingTags(OPEN, CLOSE, inside=True))
    s.add_requests([r])
    for _ in range(5):
        out = s.schedule()
        s.update(out, {"r": [WORD]})
    assert r.num_reasoning_tokens == 5
    s.stop(r, 2, "stop")
    assert r.num_reasoning_tokens == 2


def test_budget_resolution():
    tags = ThinkingTags(OPEN, CLOSE)
    with pytest.raises(InvalidParameter, match="at least 5"):
        make_requests("r", [1], thinking=tags, thinking_token_budget=4)
    with pytest.raises(InvalidParameter, match="thinking model"):
        make_requests("r", [1], thinking_token_budget=100)
    with pytest.raises(InvalidParameter, match="thinking_token_budget"):
        make_requests("r", [1], thinking=tags, thinking_token_budget=0)
    [r] = make_requests("r", [1], thinking=ThinkingTags(OPEN, CLOSE, inside=True), thinking_token_budget=3)
    assert r.params.thinking_token_budget == 3
