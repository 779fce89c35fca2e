"""Our forward pass against transformers on the embedded GGUF (same dequantized weights)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import full_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. He said",
]


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(smol, hf_smol, prompt):
    ids = smol.tokenizer.encode(prompt)
    ours = full_logits(smol.model, ids)
    ref = _hf_logits(hf_smol, ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_and_decode_paths_match_transformers(smol, hf_smol, chunk):
    ids = smol.tokenizer.encode(PROMPTS[2])
    ours = full_logits(smol.model, ids, chunk=chunk)
    ref = _hf_logits(hf_smol, ids)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_32_tokens_identical(smol, hf_smol, prompt):
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.api import SamplingParams
    from tokenmill.config import CacheConfig, EngineConfig

    ids = smol.tokenizer.encode(prompt)
    # reference: a plain argmax loop over the transformers model, no stopping rules
    ref_ids = list(ids)
    with torch.no_grad():
        out = hf_smol(torch.tensor([ref_ids]), use_cache=True)
        past = out.past_key_values
        for _ in range(32):
            nxt = int(out.logits[0, -1].argmax())
            ref_ids.append(nxt)
            out = hf_smol(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    llm = LLM(smol, config=EngineConfig(cache=CacheConfig(num_blocks=64)))
    [res] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert res.outputs[0].token_ids == ref_ids[len(ids):]
