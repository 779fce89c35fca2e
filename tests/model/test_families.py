"""Qwen3 and Gemma 3 (tokenmill/model/config.py's per-family switches) against
transformers, on tiny random checkpoints made here: Hugging Face folders and a GGUF
written with the gguf package. Gemma's sliding window is 8 keys, so short prompts
cross it, in every attention path: prefill chunks, decode, prefix-cache hits past it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import full_logits, make_engine
from tokenmill.engine.api import SamplingParams
from tokenmill.model.kernels import native_ops

transformers = pytest.importorskip("transformers")
ops = native_ops()

WINDOW = 8
GEMMA = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6,
             sliding_window=WINDOW, query_pre_attn_scalar=48,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_theta=50000.0, rope_local_base_freq=1000.0)
QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6)
KINDS = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA),
    # head_dim 256, as Gemma 3's, through the native kernels' widest instantiation
    "gemma3-d256": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    {**GEMMA, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 256, "query_pre_attn_scalar": 256}),
}


def make_checkpoint(kind: str, folder, **overrides) -> torch.nn.Module:
    """A random checkpoint of `kind` saved to `folder`; its norms are perturbed, so that
    Gemma's 1 + w and the QK-norms count."""
    cfg_cls, model_cls, kw = KINDS[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**kw, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(KINDS))
def family(request, tmp_path_factory):
    """(kind, transformers model, our float32 load) of each family."""
    from tokenmill.model.loader import load_model

    folder = tmp_path_factory.mktemp(request.param)
    ref = make_checkpoint(request.param, folder)
    return request.param, ref, load_model(str(folder), "float32"), folder


def test_config_switches(family):
    kind, _, loaded, _ = family
    cfg = loaded.config
    assert cfg.architecture == kind.split("-")[0] and cfg.qk_norm and not cfg.attention_bias
    if kind.startswith("gemma3"):
        assert cfg.output_norms and cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
        assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, 0, WINDOW]
        assert cfg.rope_theta == 50000.0 and cfg.rope_local_theta == 1000.0
        assert cfg.embed_multiplier == cfg.hidden_size ** 0.5
        assert cfg.attn_scale == KINDS[kind][2]["query_pre_attn_scalar"] ** -0.5
    else:
        assert not cfg.output_norms and cfg.hidden_act == "silu" and cfg.layer_window(0) == cfg.layer_window(1) == 0


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_logits_match_transformers(family, native):
    """Prefill in one chunk, in chunks of 7 and one token at a time (decode), 40 tokens:
    five times Gemma's window."""
    if native and ops is None:
        pytest.skip("no native build")
    _, ref, loaded, _ = family
    ids = _ids(40)
    want = _hf_logits(ref, ids)
    for chunk in (None, 7, 1):
        got = full_logits(loaded.model, ids, chunk=chunk, kernel=ops if native else None)
        assert (got - want).abs().max().item() < 1e-4, f"chunk={chunk}"


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Each request's tokens and (logprob, top) per token, and its cached prompt tokens."""
    got, cached = {}, {}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            toks, lps = got.setdefault(out.request_id, ([], []))
            toks.extend(out.new_token_ids)
            lps.extend((lp.logprob, tuple(lp.top)) for lp in out.logprobs or [])
            cached[out.request_id] = out.num_cached_tokens
        engine.kv.check_integrity()
    return got, cached


def _greedy_reference(ref, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(_hf_logits(ref, out)[-1].argmax()))
    return out[len(ids):]


def _three(base_seed: int, sp: SamplingParams) -> dict[str, tuple[list[int], SamplingParams]]:
    """Three requests: b's prompt extends a's (30 tokens, several windows), c is short."""
    base = _ids(30, seed=base_seed)
    return {"a": (base, sp), "b": (base + _ids(6, seed=base_seed + 1), sp), "c": (_ids(11, seed=base_seed + 2), sp)}


def _alone_batched_after_hit(loaded, requests):
    """Each request alone (a fresh engine each), all batched, and b after a's prompt is
    cached, in a paged cache of 4-token blocks; asserts the hit reaches past the window."""
    alone = {rid: _run(make_engine(loaded, num_blocks=64, block_size=4), {rid: r})[0][rid]
             for rid, r in requests.items()}
    batched, _ = _run(make_engine(loaded, num_blocks=64, block_size=4), requests)
    engine = make_engine(loaded, num_blocks=64, block_size=4)
    _run(engine, {"a": requests["a"]})
    later, cached = _run(engine, {"b": requests["b"]})
    assert cached["b"] >= 3 * WINDOW  # the hit covers several windows
    return alone, batched, later["b"]


def test_engine_exact_mode_matches_transformers(family):
    """Exact mode through the engine (native kernels): greedy tokens equal transformers'
    alone, batched, and after a prefix-cache hit past the window; logprobs agree to
    float32 rounding (dense float32 matmuls round by row count)."""
    _, ref, loaded, _ = family
    requests = _three(2, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    alone, batched, hit = _alone_batched_after_hit(loaded, requests)
    for rid, (ids, _) in requests.items():
        assert alone[rid][0] == _greedy_reference(ref, ids, 12) == batched[rid][0], rid
    assert hit[0] == alone["b"][0]
    for got in (batched["b"], hit):
        assert np.allclose([lp for lp, _ in got[1]], [lp for lp, _ in alone["b"][1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3"])
def test_default_mode_does_not_depend_on_batch_or_cache(tmp_path, kind):
    """bfloat16 with int4 matmuls (the default): GeGLU, QK-norm and the sliding window in
    the native ops keep a request's tokens and logprobs bit for bit the same alone,
    batched and after a prefix-cache hit past the window, near float32's answers."""
    from tokenmill.model.loader import load_model

    make_checkpoint(kind, tmp_path)
    loaded = load_model(str(tmp_path), "bfloat16", "int4")
    assert loaded.model.dtype == torch.bfloat16
    requests = _three(5, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1))
    alone, batched, hit = _alone_batched_after_hit(loaded, requests)
    assert batched == alone and hit == alone["b"]
    assert all(np.isfinite([lp for lp, _ in lps]).all() for _, lps in alone.values())


# ---- GGUF ----

def write_gguf(folder, path, arch: str, qtype=None) -> None:
    """The checkpoint in `folder` as a GGUF laid out as llama.cpp's conversion writes it:
    its tensor names and metadata keys (gguf's constants), Gemma's norms stored as 1 + w,
    the output projection left out when tied; the layers' matrices in `qtype` blocks
    (gguf's reference quantization), else everything float32."""
    import json

    import gguf
    from safetensors.torch import load_file

    with open(folder / "config.json") as f:
        hf = json.load(f)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf["rope_parameters"]
    if arch == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(hf["sliding_window"])
        # (llama.cpp's conversion leaves these two to its defaults, which real Gemma 3
        # checkpoints match and this one does not: see test_gguf_gemma3_defaults_are_llama_cpps)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    tokens = [f"<t{i}>" for i in range(hf["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    if arch == "gemma3":
        layer.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        layer["post_attention_layernorm"] = "ffn_norm"
    for name, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{layer[rest.rsplit('.', 1)[0]]}.weight"
        else:
            gname = names[name]
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0
        if qtype is not None and gname.startswith("blk.") and t.dim() == 2:
            w.add_tensor(gname, gguf.quants.quantize(t.float().numpy(), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["gemma3", "qwen3"])
def test_gguf_loads_equal_to_the_folder(tmp_path, kind):
    """The same checkpoint from a GGUF and from its folder: the same switches and
    bit-identical logits (prefill and decode, native kernels), equal to transformers'."""
    from tokenmill.model.loader import load_model

    folder = tmp_path / "hf"
    # (llama.cpp scales Gemma's attention by head_dim, as real checkpoints do)
    ref = make_checkpoint(kind, folder, **({"query_pre_attn_scalar": 64} if kind == "gemma3" else {}))
    path = tmp_path / f"{kind}.gguf"
    write_gguf(folder, path, kind)
    from_gguf, from_folder = load_model(str(path), "float32"), load_model(str(folder), "float32")
    a, b = from_gguf.config, from_folder.config
    for key in ("architecture", "qk_norm", "output_norms", "hidden_act", "embed_multiplier", "attn_scale",
                "sliding_window", "layer_types", "rope_theta", "rope_local_theta", "tie_word_embeddings",
                "head_dim", "vocab_size"):
        assert getattr(a, key) == getattr(b, key), key
    ids = _ids(40)
    want = _hf_logits(ref, ids)
    for chunk in (None, 1):
        got = full_logits(from_gguf.model, ids, chunk=chunk, kernel=ops)
        assert torch.equal(got, full_logits(from_folder.model, ids, chunk=chunk, kernel=ops)), f"chunk={chunk}"
        assert (got - want).abs().max().item() < 1e-4


def test_gguf_gemma3_blocks_load_as_the_file_stores_them(tmp_path):
    """A Gemma 3 GGUF with Q4_0 layers runs (--quantization auto) on the file's own
    blocks: every layer matmul holds exactly gguf's dequantization of them, and decodes
    through the fused step."""
    from gguf import GGMLQuantizationType, quants

    from tokenmill.model.gguf_loader import GGUFFile
    from tokenmill.model.loader import load_model

    folder = tmp_path / "hf"
    make_checkpoint("gemma3", folder, query_pre_attn_scalar=64)
    path = tmp_path / "q4.gguf"
    q4 = GGMLQuantizationType.Q4_0
    write_gguf(folder, path, "gemma3", q4)
    loaded = load_model(str(path), "bfloat16", "auto")
    assert loaded.quantization == "int4"
    gf = GGUFFile(str(path))

    def stored(name: str) -> torch.Tensor:
        assert gf.qtype(name) == q4
        rows, cols = (int(x) for x in reversed(gf.tensors[name].shape))
        return torch.from_numpy(quants.dequantize(gf.raw_blocks(name), q4).reshape(rows, cols))

    for i, layer in enumerate(loaded.model.layers):
        parts = {
            layer.qkv: [f"blk.{i}.attn_{x}.weight" for x in "qkv"], layer.o_proj: [f"blk.{i}.attn_output.weight"],
            layer.gate_up: [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"],
            layer.down: [f"blk.{i}.ffn_down.weight"],
        }
        for lin, names in parts.items():
            assert torch.equal(lin.dequantize().float(), torch.cat([stored(n) for n in names])), names
    engine = make_engine(loaded, num_blocks=64, block_size=4)
    counter = engine.runner.fused.native = _Counting(engine.runner.fused.native)
    got, _ = _run(engine, {"a": (_ids(20), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))})
    assert len(got["a"][0]) == 8 and (counter.rows or counter.burst_steps)


def test_gguf_gemma3_defaults_are_llama_cpps():
    """Keys a Gemma 3 GGUF leaves out take llama.cpp's values: every sixth layer global,
    a local RoPE base of 10,000, the attention scaled by head_dim."""
    from tokenmill.model.config import ModelConfig

    md = {"general.architecture": "gemma3", "gemma3.attention.head_count": 4, "gemma3.embedding_length": 640,
          "gemma3.block_count": 12, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count_kv": 1,
          "gemma3.attention.key_length": 256, "gemma3.attention.sliding_window": 512,
          "gemma3.rope.freq_base": 1e6, "gemma3.vocab_size": 262144}
    cfg = ModelConfig.from_gguf_metadata(md, "g", has_output_tensor=False)
    assert [i for i in range(12) if not cfg.is_sliding(i)] == [5, 11]
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6 and cfg.attn_scale == 256 ** -0.5
    assert cfg.head_dim == 256 and cfg.tie_word_embeddings and cfg.embed_multiplier == 640 ** 0.5


def test_gguf_gemma_tokenizer_equals_transformers(tmp_path):
    """A Gemma-style sentencepiece vocabulary in a GGUF (tokenizer.ggml.model "llama"):
    our tokenizer gives the ids and text transformers' GGUF loader gives."""
    import gguf

    from tokenmill.model.tokenizer import Tokenizer

    control, unknown, user, byte, normal = 3, 2, 4, 6, 1
    vocab = [("<pad>", control), ("<eos>", control), ("<bos>", control), ("<unk>", unknown),
             ("<start_of_turn>", user), ("<end_of_turn>", user)]
    vocab += [(f"<0x{b:02X}>", byte) for b in range(256)]
    pieces = ["\u2581", "t", "h", "e", "c", "a", "s", "i", "o", "n", "m", "u", "r", "\n", "he", "\u2581t", "at",
              "\u2581the", "\u2581c", "\u2581cat", "\u2581s", "\u2581sat", "on", "\u2581on", "\u2581m", "\u2581mat",
              "  ", "   ", "is", "\u2581is", "in", "er", "us", "\u2581us", "user"]
    vocab += [(p, normal) for p in pieces]
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_scores([0.0] * len(vocab))  # (Gemma's scores do not order its merges)
    w.add_token_types([ty for _, ty in vocab])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from tokenmill.model.gguf_reader import GGUFReader

    ours = Tokenizer.from_gguf_metadata(GGUFReader(str(path)).metadata)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    texts = ["the cat sat on the mat", "  the  cat   is in", "<start_of_turn>user\nthe mat<end_of_turn>\n",
             "unicorns é 🙂 x", " leading space", ""]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.encode("the cat")[0] == 2 and ours.eos_token_ids == (1,)
    # the merges are transformers' (generate_merges with each token's score its -index)
    from transformers.tokenization_utils_base import generate_merges

    from tokenmill.model.tokenizer import merges_from_vocabulary

    tokens = {t: i for i, (t, _) in enumerate(vocab)}
    assert merges_from_vocabulary(tokens) == generate_merges(tokens, {t: -i for t, i in tokens.items()})
    assert 3 not in ours.encode("the cat sat é")  # byte fallback, not <unk>


# ---- the fused decode step and bursts ----

class _Counting:
    """Stands in for the native DecodeModel to count the rows of the steps it ran."""

    def __init__(self, inner):
        self.inner, self.rows, self.burst_steps = inner, [], 0

    def forward(self, h, *args):
        self.rows.append(h.shape[0])
        return self.inner.forward(h, *args)

    def forward_logits(self, ids, *args):
        self.rows.append(ids.shape[0])
        return self.inner.forward_logits(ids, *args)

    def decode_steps(self, ids, *args):
        self.burst_steps += args[4]  # steps
        return self.inner.decode_steps(ids, *args)


def _quantized(kind: str, folder):
    from tokenmill.model.loader import load_model

    make_checkpoint(kind, folder)
    return load_model(str(folder), "bfloat16", "int4")


@pytest.mark.parametrize("kind,kv", [(k, "auto") for k in sorted(KINDS)] + [("gemma3", "int8")])
def test_fused_decode_step_equals_separate_ops(tmp_path, kind, kv):
    """Decode steps of 1-3 rows as one native call (QK-norm, Gemma's output norms, GeGLU,
    scaled embeddings, the sliding window with its own RoPE, head_dim 256; an int8 KV
    cache) give the tokens and logprobs of the model's separate native ops, as decodes
    cross the window."""
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    loaded = _quantized(kind, tmp_path)
    # different lengths: 3 sequences decoding at once, then 2, then 1
    requests = {rid: (ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2))
                for (rid, (ids, _)), n in zip(_three(8, SamplingParams()).items(), (14, 10, 6))}
    results = {}
    for fused in (True, False):
        engine = make_engine(loaded, num_blocks=64, block_size=4, decode_steps=1, prefix_caching=False,
                             kv_cache_dtype=kv)
        decoder = engine.runner.fused
        assert decoder is not None and decoder.has_head, "the model has no fused step"
        if fused:
            counter = decoder.native = _Counting(decoder.native)
        else:
            engine.runner.fused = None  # the model's separate native ops
        results[fused] = _run(engine, requests)[0]
    assert counter.rows and set(counter.rows) == {1, 2, 3}
    assert results[True] == results[False]
    assert len({t for toks, _ in results[True].values() for t in toks}) > 3


@pytest.mark.parametrize("kind", ["gemma3", "qwen3"])
def test_bursts_equal_single_steps(tmp_path, kind):
    """Several decode steps in one native call (greedy, seeded sampled, truncated) give
    the tokens one step at a time gives."""
    if ops is None or not ops.decode_step_available():
        pytest.skip("the native decode loop needs the build with AVX-512 VNNI and BF16")
    loaded = _quantized(kind, tmp_path)
    requests = {
        "greedy": (_ids(30, seed=9), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        "sampled": (_ids(12, seed=10), SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)),
        "top_p": (_ids(5, seed=11), SamplingParams(temperature=1.1, top_p=0.8, top_k=40, seed=4, max_tokens=20,
                                                    ignore_eos=True)),
    }
    one, _ = _run(make_engine(loaded, num_blocks=64, block_size=4, decode_steps=1), requests)
    engine = make_engine(loaded, num_blocks=64, block_size=4, decode_steps=8)
    counter = engine.runner.fused.native = _Counting(engine.runner.fused.native)
    burst, _ = _run(engine, requests)
    assert {r: t for r, (t, _) in burst.items()} == {r: t for r, (t, _) in one.items()}
    assert counter.burst_steps >= 10  # the bursts ran natively
