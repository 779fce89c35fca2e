"""Batched must equal unbatched: alone, in a mixed batch, chunked, and after preemption."""

from __future__ import annotations

import pytest

from tests.helpers import make_engine, run_to_completion
from tokenmill.engine.api import SamplingParams

TOPICS = ["the sea", "a cat", "mathematics", "Paris", "rain", "coffee", "the moon", "trains",
          "music", "gardens", "winter", "robots", "bread", "mountains", "books", "time"]


@pytest.fixture(scope="module")
def prompts(smol):
    tok = smol.tokenizer
    out = []
    for i, topic in enumerate(TOPICS):
        body = f"Tell me about {topic}." + (" Please be detailed and precise." * (i * 3))
        out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": body}]),
                              add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def alone(smol, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = make_engine(smol, num_blocks=256)
    result = {}
    for i, ids in enumerate(prompts):
        toks, _, _ = run_to_completion(engine, {f"r{i}": (ids, params)})
        result[f"r{i}"] = toks[f"r{i}"][0]
    return result


def _batch(engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    toks, _, _ = run_to_completion(engine, {f"r{i}": (ids, params) for i, ids in enumerate(prompts)},
                                   check=lambda e: e.kv.check_integrity())
    return {rid: v[0] for rid, v in toks.items()}


@pytest.mark.slow
def test_prompt_lengths_are_mixed(prompts):
    lens = sorted(len(p) for p in prompts)
    assert len(prompts) == 16 and lens[0] < 40 and lens[-1] > 200


@pytest.mark.slow
def test_batch_of_16_equals_alone(smol, prompts, alone):
    assert _batch(make_engine(smol, num_blocks=512), prompts) == alone


@pytest.mark.slow
def test_chunked_prefill_tiny_budget_equals_alone(smol, prompts, alone):
    engine = make_engine(smol, num_blocks=512, max_num_batched_tokens=13)
    assert _batch(engine, prompts) == alone


@pytest.mark.slow
def test_preemption_small_pool_equals_alone(smol, prompts, alone):
    # 24 blocks of 16 = 384 tokens: far less than the ~2600 the batch needs at once
    engine = make_engine(smol, num_blocks=24, prefix_caching=False)
    got = _batch(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert got == alone
    assert engine.kv.num_used_blocks == 0


@pytest.mark.slow
def test_preemption_with_prefix_cache_equals_alone(smol, prompts, alone):
    engine = make_engine(smol, num_blocks=24, prefix_caching=True, max_num_batched_tokens=64)
    got = _batch(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert got == alone
