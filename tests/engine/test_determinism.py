"""A request's tokens do not depend on what else the engine runs (the default mode:
bfloat16, int4 layers, int8 output projection): a seeded sampled request and a greedy
one give the same tokens alone, in a batch of 16 mixed requests, after their prompt's
prefix was cached (the rest then prefilled as a shorter chunk after cached context, down
to a single token), and with chunked prefill. That holds because every op computes each
row the same way whatever the other rows: the quantized matmuls (one kernel for every
row count) and attention (each query row over the cache, in an order set by its own
context; tokenmill/model/attention.py)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM

BLOCK = 16
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _ids(n: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % 4000 + 300 for i in range(n)]


# three full blocks: a later request with the same prompt finds all but its last token
# cached and prefills that one alone
PROMPT = _ids(3 * BLOCK, 1)


def _llm(model, max_batched: int = 512) -> LLM:
    return LLM(model, config=EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_batched)))


def _gen(llm: LLM, prompts, params) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("rows", [16, 64, 200])
def test_linear_rows_do_not_depend_on_the_row_count(smol_int4, rows):
    model = smol_int4.model
    layer = model.layers[0]
    g = torch.Generator().manual_seed(rows)
    for name, lin in (("qkv", layer.qkv), ("o_proj", layer.o_proj), ("gate_up", layer.gate_up),
                      ("down", layer.down), ("lm_head", model.lm_head)):
        x = torch.randn(rows, lin.in_features, generator=g).to(torch.bfloat16)
        many = lin(x)
        # rows at every position within the kernels' groups of 4, and the last
        for i in sorted({0, 1, 2, 3, 6, 13, rows // 2 + 1, rows - 1}):
            assert torch.equal(lin(x[i:i + 1])[0], many[i]), f"{name}: row {i} of {rows}"


@pytest.mark.slow
def test_tokens_do_not_depend_on_batch_cache_or_chunks(smol_int4):
    both = [PROMPT, PROMPT]
    params = [SEEDED, GREEDY]
    alone = [_gen(_llm(smol_int4), [PROMPT], p)[0] for p in params]
    assert alone[0] != alone[1]  # (the seeded one samples)

    # 16 requests: different prompt lengths, some sampled (seeded or not), some greedy
    others = [_ids(5 + 7 * i, 100 + i) for i in range(14)]
    other_params = [SamplingParams(temperature=0.8 if i % 3 else 0.0, seed=i if i % 2 else None,
                                   max_tokens=8 + 2 * i, ignore_eos=True) for i in range(14)]
    batch = _gen(_llm(smol_int4), others[:5] + both + others[5:], other_params[:5] + params + other_params[5:])
    assert batch[5:7] == alone

    # a request sharing the first two blocks runs first; then the prompt itself is cached
    llm = _llm(smol_int4)
    _gen(llm, [PROMPT[:2 * BLOCK] + _ids(20, 7)], GREEDY)
    after_shared = llm.generate([PROMPT], SEEDED)[0]
    after_same = llm.generate([PROMPT], GREEDY)[0]
    assert after_shared.num_cached_tokens == 2 * BLOCK and after_same.num_cached_tokens >= 2 * BLOCK
    assert [after_shared.outputs[0].token_ids, after_same.outputs[0].token_ids] == alone

    # prefill in chunks of 16 tokens, both at once
    assert _gen(_llm(smol_int4, max_batched=BLOCK), both, params) == alone
