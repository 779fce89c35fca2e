"""Embedding requests (SamplingParams.pooling) through the engine: the prompt's final
hidden states (after the final norm) pooled, nothing decoded, against transformers'
`last_hidden_state` on a tiny random Llama checkpoint and on the embedded model; the
same vector whatever the batch, the chunking or a preemption."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_engine
from tokenmill.engine.api import AdmissionError, InvalidParameter, SamplingParams

transformers = pytest.importorskip("transformers")

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, our float32 load) of one random Llama checkpoint."""
    from tokenmill.model.loader import load_model

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        ref.model.norm.weight.add_(torch.randn_like(ref.model.norm.weight) * 0.3)
    ref.save_pretrained(folder, safe_serialization=True)
    return ref, load_model(str(folder), "float32")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(ref, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = ref.model(torch.tensor([ids])).last_hidden_state[0].float()
    return h[-1] if pooling == "last" else h.mean(0)


def embed(engine, prompts: dict[str, list[int]], pooling: str, check=None) -> dict[str, torch.Tensor]:
    got = {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(pooling=pooling, max_tokens=None))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in prompts:
                continue  # a generating request beside them
            assert not out.new_token_ids  # nothing is decoded
            if out.finished:
                assert out.finish_reason == "stop" and out.num_output_tokens == 0
                got[out.request_id] = torch.tensor(out.embedding)
        if check is not None:
            check(engine)
        engine.kv.check_integrity()
    return got


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooling_matches_transformers(tiny, pooling):
    """Several prompts in one batch, longer than a step's budget (chunked prefill)."""
    ref, loaded = tiny
    prompts = {f"r{i}": _ids(n, i) for i, n in enumerate([1, 5, 40, 90])}
    got = embed(make_engine(loaded, max_num_batched_tokens=32), prompts, pooling)
    for rid, ids in prompts.items():
        want = reference(ref, ids, pooling)
        assert (got[rid] - want).abs().max().item() < 1e-4, rid


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batch_and_chunking_invariant(tiny, pooling):
    """A prompt alone, in a batch of 32 beside generating requests, and chunked small:
    the same vector (to fp32 rounding); a prefix-cache entry of the same prompt is not
    read (a mean needs every position's output)."""
    _, loaded = tiny
    ids = _ids(60, 7)
    alone = embed(make_engine(loaded), {"a": ids}, pooling)["a"]
    engine = make_engine(loaded, max_num_batched_tokens=24)
    for j in range(4):
        engine.add_request(f"gen{j}", _ids(10, 100 + j), SamplingParams(max_tokens=6, temperature=0))
    batch = embed(engine, {f"b{i}": ids if i % 2 else _ids(30 + i, 200 + i) for i in range(32)}, pooling)
    for i in range(1, 32, 2):
        assert torch.allclose(batch[f"b{i}"], alone, atol=1e-5), i


def test_preemption_recomputes(tiny):
    """A pool too small for both: the embedding, admitted last, is preempted mid-prompt
    when the generating request needs blocks, and recomputed; its mean still counts
    every position once."""
    ref, loaded = tiny
    engine = make_engine(loaded, num_blocks=10, max_num_batched_tokens=32, decode_steps=1)
    engine.add_request("gen", _ids(15, 1), SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    for _ in range(40):
        engine.step()
    ids = _ids(100, 2)
    got = embed(engine, {"e": ids}, "mean")
    assert engine.scheduler.num_preemptions > 0
    assert (got["e"] - reference(ref, ids, "mean")).abs().max().item() < 1e-4


@pytest.mark.slow
def test_embedded_model_matches_transformers(smol, hf_smol):
    prompts = {"short": [1, 504, 3250, 30], "long": _ids(50, 9)}
    for pooling in ("last", "mean"):
        got = embed(make_engine(smol), prompts, pooling)
        for rid, ids in prompts.items():
            want = reference(hf_smol, ids, pooling)
            cos = torch.nn.functional.cosine_similarity(got[rid], want, dim=0).item()
            assert cos > 0.9999 and (got[rid] - want).abs().max().item() < 1e-2 * want.abs().max().item()


def test_bounds(tiny):
    _, loaded = tiny
    limits = make_engine(loaded, max_model_len=64).limits
    with pytest.raises(InvalidParameter, match="pooling"):
        limits.resolve([[5]], SamplingParams(pooling="max"))
    with pytest.raises(InvalidParameter, match="prompt"):
        limits.resolve([[5]] * 65, SamplingParams(pooling="last"))
    with pytest.raises(AdmissionError, match="maximum context length"):
        limits.resolve([_ids(65, 1)], SamplingParams(pooling="last"))
    resolved = limits.resolve([_ids(64, 1)], SamplingParams(pooling="mean"))
    assert resolved.max_tokens == 0 and resolved.pooling == "mean"
