"""Tiny random Llama / Mistral / Qwen2 checkpoints made here, loaded through the
safetensors path, against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import full_logits

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)


def _make(kind: str, folder, **extra):
    torch.manual_seed(0)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    cfg = cfg_cls(**{**COMMON, **extra})
    model = model_cls(cfg).eval()
    if kind == "qwen2":  # random init leaves biases at zero; make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_theta": 500000.0}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {}),
]


@pytest.mark.parametrize("kind,extra", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_safetensors_checkpoint_matches_transformers(tmp_path, kind, extra):
    from tokenmill.model.loader import load_model

    ref = _make(kind, tmp_path, **extra)
    loaded = load_model(str(tmp_path), "float32")
    assert loaded.config.architecture == kind
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    for chunk in (None, 7, 1):
        got = full_logits(loaded.model, ids, chunk=chunk)
        assert (got - want).abs().max().item() < 1e-4, f"chunk={chunk}"


def test_bfloat16_load_is_close(tmp_path):
    from tokenmill.model.loader import load_model

    ref = _make("llama", tmp_path)
    loaded = load_model(str(tmp_path), "bfloat16")
    ids = list(range(1, 30))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = full_logits(loaded.model, ids)
    assert got.dtype == torch.float32  # logits come back in fp32 whatever the compute dtype
    assert (got - want).abs().max().item() < 0.1
    assert torch.equal(got.argmax(-1), want.argmax(-1))
