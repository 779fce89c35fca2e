"""The fused decode step (csrc/decode_step.cpp) against the separate native ops it
replaces, on the embedded model in the default configuration (bfloat16, int4), and the
huge-page buffers its weights and the KV cache live in."""

from __future__ import annotations

import mmap

import numpy as np

import pytest
import torch

from tests.helpers import make_engine
from tokenmill.engine.api import SamplingParams
from tokenmill.model.kernels import native_ops
from tokenmill.model.memory import HUGE_PAGE, hugepage_zeros, pack_together

ops = native_ops()


class _Counting:
    """Stands in for the native DecodeModel to count the steps it ran."""

    def __init__(self, inner):
        self.inner, self.calls, self.rows = inner, 0, set()

    def __getattr__(self, name):  # bind_cache and the rest: the real model's
        return getattr(self.inner, name)

    def forward(self, h, *args):
        self.calls += 1
        self.rows.add(h.shape[0])
        return self.inner.forward(h, *args)

    def forward_logits(self, ids, *args):
        self.calls += 1
        self.rows.add(ids.shape[0])
        return self.inner.forward_logits(ids, *args)

    def decode_steps(self, ids, *args):
        self.calls += args[4]  # steps
        self.rows.add(ids.shape[0])
        return self.inner.decode_steps(ids, *args)


def _run_to_end(engine) -> tuple[dict, dict]:
    """Steps until every request ends: each request's tokens and (logprob, top) pairs."""
    tokens, logprobs = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend((lp.logprob, tuple(lp.top)) for lp in out.logprobs)
    return tokens, logprobs


@pytest.mark.parametrize("which", ["smol_int4", "smol_int8"])
def test_fused_decode_step_equals_separate_ops(which, request):
    """int4 layers, and int8 ones (Q8_0 block tiles), run fused as they run op by op."""
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    smol_int4 = request.getfixturevalue(which)
    tok = smol_int4.tokenizer
    prompts = {
        "short": tok.encode("The capital of France is"),
        "mid": tok.encode("Once upon a time, in a land far away, there lived a king who") * 4,
        # past one attention chunk, so chunks are merged
        "long": tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,") * 12,
        "code": tok.encode("def fibonacci(n):"),
        "chat": tok.encode("Q: What is the boiling point of water?\nA:"),
    }
    assert len(prompts["long"]) > 300
    # different lengths: 5 sequences decoding at once (past the kernels' 4-row blocks),
    # then 4, 3, 2, 1
    lengths = {"short": 30, "mid": 20, "long": 10, "code": 25, "chat": 15}
    results = {}
    for fused in (True, False):
        engine = make_engine(smol_int4, num_blocks=128, prefix_caching=False)
        decoder = engine.runner.fused
        if fused:  # counts the steps the native DecodeModel runs
            counter = decoder.native = _Counting(decoder.native)
        else:
            engine.runner.fused = None  # the model's separate native ops
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, SamplingParams(max_tokens=lengths[rid], temperature=0, ignore_eos=True,
                                                        logprobs=3))
        tokens, logprobs = _run_to_end(engine)
        results[fused] = (tokens, logprobs)
        if fused:
            assert counter.calls >= 25 and counter.rows == {1, 2, 3, 4, 5}
    assert results[True][0] == results[False][0]
    # bit-identical numerics: the same logprobs, not just the same argmax
    assert results[True][1] == results[False][1]
    assert {rid: len(t) for rid, t in results[True][0].items()} == lengths


def test_fused_decode_step_rejects_mismatched_weights(smol_int4):
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    model = smol_int4.model
    cfg = model.cfg
    layer = model.layers[0]
    mats = [layer.qkv.tiles, layer.o_proj.tiles, layer.gate_up.tiles, layer.down.tiles]
    norms = [layer.input_norm, layer.post_norm, model.norm]
    no_bias = [torch.empty(0, dtype=torch.bfloat16)] * 4
    args = (model.cos32, model.sin32, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.scale)
    dm = ops.DecodeModel(mats, [2, 1, 1, 2], norms, *args, no_bias)  # one layer builds
    with pytest.raises(RuntimeError, match="a bias .* for each matmul"):
        ops.DecodeModel(mats, [2, 1, 1, 2], norms, *args, no_bias[:3])
    with pytest.raises(RuntimeError, match=r"bias 0: contiguous bfloat16 \[N\]"):
        ops.DecodeModel(mats, [2, 1, 1, 2], norms, *args, [torch.zeros(7, dtype=torch.bfloat16)] + no_bias[1:])
    k = torch.zeros(cfg.num_kv_heads, 64, cfg.head_dim, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 or int8, the same slots"):
        dm.bind_cache([k], [k.float()], [], [])
    with pytest.raises(RuntimeError, match="scales for each layer of an int8 cache"):
        dm.bind_cache([k.to(torch.int8)], [k.to(torch.int8)], [], [])
    with pytest.raises(RuntimeError, match="scales float32"):
        scales = torch.zeros(cfg.num_kv_heads, 32)
        dm.bind_cache([k.to(torch.int8)], [k.to(torch.int8)], [scales], [scales])
    with pytest.raises(RuntimeError, match="2 norms a layer"):
        ops.DecodeModel(mats, [1] * 4, norms[:2], *args, no_bias)
    with pytest.raises(RuntimeError, match="do not chain"):
        ops.DecodeModel([mats[1], mats[0], mats[2], mats[3]], [1] * 4, norms, *args, no_bias)
    with pytest.raises(RuntimeError, match="bind_cache first"):
        dm.forward(torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64),
                   torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                   torch.ones(1, dtype=torch.int64), 16)
    k = torch.zeros(cfg.num_kv_heads, 64, cfg.head_dim, dtype=torch.bfloat16)
    dm.bind_cache([k], [k.clone()], [], [])
    with pytest.raises(RuntimeError, match="position out of range"):
        dm.forward(torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16), torch.tensor([10 ** 7]),
                   torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                   torch.ones(1, dtype=torch.int64), 16)
    with pytest.raises(RuntimeError, match="slot or length out of range"):
        dm.forward(torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64),
                   torch.tensor([64]), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 16)


def _fused_on_new_cache(loaded):
    """The model's native DecodeModel, bound to a fresh engine's (64-block) cache."""
    engine = make_engine(loaded, num_blocks=64, prefix_caching=False)
    engine.add_request("warm", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()
    decoder = engine.runner.fused
    assert decoder and decoder.has_head
    fused = decoder.native
    fused.bind_cache(*zip(*[engine.kv_cache.layer(i) for i in range(loaded.model.cfg.num_layers)]), [], [])
    return fused


def test_fused_logits_equal_forward_then_output_projection(smol_int4):
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    model = smol_int4.model
    cfg = model.cfg
    fused = _fused_on_new_cache(smol_int4)
    # three sequences at their first decode step: 1, 5 and 9 tokens of context (the cache
    # as the warm-up left it), one block table each
    lens = torch.tensor([1, 5, 9])
    tables = torch.tensor([[0], [1], [2]])
    positions = lens - 1
    slots = tables[:, 0] * 16 + positions
    ids = torch.tensor([17, 4242, cfg.vocab_size - 1])
    args = (positions, slots, tables, lens, 16)
    hidden = fused.forward(model.embed[ids], *args)
    want = model.logits(hidden)
    logits, best = fused.forward_logits(ids, *args)
    assert logits.dtype == torch.float32 and logits.shape == (3, cfg.vocab_size)
    assert torch.equal(logits, want)
    assert torch.equal(best, torch.from_numpy(want.numpy().argmax(axis=-1)))
    with pytest.raises(RuntimeError, match="token id out of range"):
        fused.forward_logits(torch.tensor([cfg.vocab_size]), *[a[:1] for a in args[:4]], 16)
    with pytest.raises(RuntimeError, match="head: uint8"):
        fused.set_head(model.embed, model.lm_head.tiles[:, :-1].contiguous())
    with pytest.raises(RuntimeError, match="embed: contiguous bf16"):
        fused.set_head(model.embed.float(), model.lm_head.tiles)


def _no_truncation(M):
    return torch.zeros(M, dtype=torch.int64), torch.ones(M), torch.zeros(M)


def _steps(fused, ids, positions, tables, lens, bs, steps, temps=None, seeds=None, indices=None, truncs=None):
    M = ids.shape[0]
    temps = torch.zeros(M) if temps is None else temps
    seeds = torch.zeros(M, dtype=torch.int64) if seeds is None else seeds
    indices = torch.zeros(M, dtype=torch.int64) if indices is None else indices
    truncs = _no_truncation(M) if truncs is None else truncs
    return fused.decode_steps(ids, positions, tables, lens, bs, steps, temps, seeds, indices, *truncs)


def test_decode_steps_sampled_equal_forward_logits_and_sample_rows(smol_int4):
    """Sampled rows of a burst draw as the engine's sampler (sample_rows) would step by
    step, with the uniform of (seed, index + step) and each row's truncation (top-k,
    top-p, min-p); a greedy row beside them is the argmax."""
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    fused = _fused_on_new_cache(smol_int4)
    lens = torch.tensor([3, 7, 2, 5, 4])
    tables = torch.tensor([[0, 5], [1, 6], [2, 7], [3, 8], [4, 9]])
    ids = torch.tensor([17, 4242, 99, 310, 2048])
    temps = torch.tensor([1.0, 0.0, 0.6, 1.3, 0.9])
    seeds = torch.tensor([7, 8, -(2 ** 63), 9, 10], dtype=torch.int64)  # any 64 bits
    indices = torch.tensor([0, 5, 11, 2, 40], dtype=torch.int64)
    truncs = (torch.tensor([0, 0, 40, 0, 5]), torch.tensor([1.0, 1.0, 1.0, 0.8, 0.95]),
              torch.tensor([0.0, 0.0, 0.0, 0.0, 0.02]))
    steps = 6
    got = _steps(fused, ids, lens - 1, tables, lens, 16, steps, temps, seeds, indices, truncs)
    want, cur, plain = [], ids, []
    for s in range(steps):
        pos = lens - 1 + s
        slots = tables.gather(1, (pos // 16).unsqueeze(1)).squeeze(1) * 16 + pos % 16
        logits, best = fused.forward_logits(cur, pos, slots, tables, lens + s, 16)
        drawn = ops.sample_rows(logits, temps.clamp(min=1e-3), seeds, indices + s, *truncs)
        plain.append(ops.sample_rows(logits, temps.clamp(min=1e-3), seeds, indices + s, *_no_truncation(5)))
        cur = torch.where(temps > 0, drawn, best)
        want.append(cur)
    assert torch.equal(got, torch.stack(want))
    assert len(set(got[:, 0].tolist())) > 1
    assert not torch.equal(got[:, 2:], torch.stack(plain)[:, 2:])  # the truncation changed some draws


def test_sample_rows_follows_the_distribution():
    """The native draw: inverse CDF of softmax(logits / T) from one uniform per (seed, index)."""
    if ops is None:
        pytest.skip("no native build")
    from tokenmill.engine.sampler import position_seed

    logits = torch.tensor([[2.0, 1.0, 0.0, -1e30, 0.5] + [-50.0] * 11])
    n = 6000
    seeds = torch.arange(n, dtype=torch.int64)
    idx = torch.full((n,), 3, dtype=torch.int64)
    for T in (1.0, 0.5):
        got = ops.sample_rows(logits.repeat(n, 1), torch.full((n,), T), seeds, idx, *_no_truncation(n))
        p = torch.softmax(logits[0] / T, dim=0)
        counts = torch.bincount(got, minlength=16).float()
        assert counts[3] == 0 and counts[5:].sum() == 0  # masked and negligible tokens never come
        sd = (n * p[:3] * (1 - p[:3])).sqrt()
        assert ((counts[:3] - n * p[:3]).abs() < 4 * sd + 1).all(), (counts, n * p)
    # the uniform of (seed, index) is splitmix64's, as the Python side computes it
    u = (position_seed(12345, 6) >> 11) / 2 ** 53
    row = torch.tensor([[0.0, 0.0]])  # two equal weights: token 1 iff u * 2 >= 1
    tok = ops.sample_rows(row, torch.tensor([1.0]), torch.tensor([12345]), torch.tensor([6]), *_no_truncation(1))
    assert int(tok) == int(u >= 0.5)


def test_decode_greedy_equals_forward_logits_step_by_step(smol_int4):
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    cfg = smol_int4.model.cfg
    fused = _fused_on_new_cache(smol_int4)
    # three sequences of 1, 5 and 14 tokens (the cache as the warm-up left it); the third
    # crosses into its second block on the way
    lens = torch.tensor([1, 5, 14])
    tables = torch.tensor([[0, 3], [1, 4], [2, 5]])
    ids = torch.tensor([17, 4242, cfg.vocab_size - 1])
    steps = 6
    got = _steps(fused, ids, lens - 1, tables, lens, 16, steps)
    assert got.dtype == torch.int64 and got.shape == (steps, 3)
    want, cur = [], ids
    for s in range(steps):
        pos = lens - 1 + s
        slots = tables.gather(1, (pos // 16).unsqueeze(1)).squeeze(1) * 16 + pos % 16
        logits, cur = fused.forward_logits(cur, pos, slots, tables, lens + s, 16)
        assert torch.equal(cur, torch.from_numpy(logits.numpy().argmax(axis=-1)))
        want.append(cur)
    assert torch.equal(got, torch.stack(want))
    assert len(set(got[:, 2].tolist())) > 1  # a real continuation, not one token repeated
    with pytest.raises(RuntimeError, match="steps must be positive"):
        _steps(fused, ids, lens - 1, tables, lens, 16, 0)
    with pytest.raises(RuntimeError, match="do not hold every step"):
        _steps(fused, ids, lens - 1, tables, lens, 16, 20)
    with pytest.raises(RuntimeError, match="block id out of range"):
        _steps(fused, ids, lens - 1, torch.tensor([[0, 3], [1, 4], [2, 10 ** 6]]), lens, 16, steps)
    with pytest.raises(RuntimeError, match="token id out of range"):
        _steps(fused, torch.tensor([-1, 0, 0]), lens - 1, tables, lens, 16, 1)
    with pytest.raises(RuntimeError, match="positions are their lengths - 1"):
        _steps(fused, ids, lens + 20, tables, lens, 16, 1)
    with pytest.raises(RuntimeError, match="block_size must be positive"):
        _steps(fused, ids, lens - 1, tables, lens, 0, 1)
    # strided inputs are read as their values
    strided = torch.stack([ids, ids], dim=1)[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(_steps(fused, strided, lens - 1, tables, lens, 16, steps), got)


def test_fused_argmax_is_the_first_maximum_nan_largest():
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(24576, generator=gen) for _ in range(4)]
    tie = torch.randn(64, generator=gen)
    tie[3] = tie[19] = tie[50] = 9.0  # the same maximum in three lanes and two vectors
    rows.append(tie)
    signed_zero = torch.full((32,), -1.0)
    signed_zero[7], signed_zero[5] = 0.0, -0.0  # equal as numbers: the first one wins
    rows.append(signed_zero)
    for special in (float("inf"), float("-inf"), float("nan")):
        r = torch.randn(4096, generator=gen)
        r[1000] = special
        r[3000] = special
        rows.append(r)
    rows.append(torch.full((16,), float("-inf")))
    rows.append(torch.full((48,), float("nan")))
    for r in rows:
        assert ops.first_max(r) == int(np.argmax(r.numpy())), r[:8]
    with pytest.raises(RuntimeError, match="float32"):
        ops.first_max(torch.zeros(17))


def test_hugepage_zeros_and_packing():
    big = hugepage_zeros((3, HUGE_PAGE // 4 + 5), torch.float32)  # past a page, not a multiple
    assert big.shape == (3, HUGE_PAGE // 4 + 5) and big.dtype == torch.float32
    assert not big.any()
    big[2, -1] = 7.0  # writable to the last element
    if getattr(mmap, "MADV_HUGEPAGE", None) is not None:
        assert big.data_ptr() % HUGE_PAGE == 0
    small = hugepage_zeros((4, 5), torch.bfloat16)  # too small for a page of its own
    assert small.shape == (4, 5) and not small.any()

    parts = [torch.arange(n, dtype=torch.uint8) for n in (100, 64, 1)] + [torch.randn(1 << 20)]
    originals = [p.clone() for p in parts]
    packed: list = [None] * len(parts)
    sources: list = []

    def placed(i, source, copy):
        packed[i] = copy
        sources.append(source)
        assert parts[i] is None  # the list let go of it before the call

    pack_together(parts, placed)
    assert [s.data_ptr() for s in sources] != [p.data_ptr() for p in packed]
    parts = originals
    for a, b in zip(parts, packed):
        assert torch.equal(a, b) and b.dtype == a.dtype and b.data_ptr() % 64 == 0
    ends = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in packed)
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:]))  # no overlap
    packed[0].fill_(0)
    assert torch.equal(packed[1], parts[1])  # writes stay in their own tensor


def _greedy_fused_and_not(loaded, what: str) -> dict:
    """Three prompts, 12 greedy tokens each with their top-2 logprobs, once on the fused
    step (asserted taken) and once on the model's separate native ops: {fused: (tokens,
    logprobs)}."""
    prompts = {"a": [5, 17, 200, 3], "b": list(range(40, 80)), "c": [300, 1]}
    results = {}
    for fused in (True, False):
        engine = make_engine(loaded, num_blocks=32, prefix_caching=False)
        decoder = engine.runner.fused
        if not fused:
            engine.runner.fused = None  # the model's separate native ops
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
        tokens, logprobs = _run_to_end(engine)
        results[fused] = (tokens, logprobs)
        if fused:
            assert decoder, f"the {what} did not take the fused step"
    assert all(len(t) == 12 for t in results[True][0].values())
    return results


def test_fused_decode_step_with_qkv_bias_equals_separate_ops(tmp_path):
    """A Qwen2 checkpoint (biases on q, k, v) runs fused too, bias added as the separate
    ops add it: the same tokens and logprobs either way."""
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    transformers = pytest.importorskip("transformers")
    from tokenmill.model.loader import load_model

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                   max_position_embeddings=256, rms_norm_eps=1e-6)
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path), "bfloat16", "int4")
    model = loaded.model
    assert model.layers[0].qkv.bias is not None
    results = _greedy_fused_and_not(loaded, "biased model")
    assert results[True] == results[False]


def test_fused_decode_step_with_q5_0_and_wide_blocks_equals_separate_ops(tmp_path):
    """A K-quant-style mix as llama-quantize writes it for Qwen (most layers Q5_0, some in
    Q8_0): int4 mode keeps Q5_0 layers in Q5_0 tiles with the file's own weights, a layer
    with a part in wider blocks at 8 bits, and the fused step runs both kinds as the
    separate ops do, with inputs in two int8 levels and in one: the same tokens and
    logprobs."""
    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    transformers = pytest.importorskip("transformers")
    import numpy as np
    from gguf import GGMLQuantizationType as G, quants

    from tokenmill.model.gguf_loader import q5_0_codes
    from tokenmill.model.loader import LoadedModel, StoredBlocks, build_model, set_activation_levels
    from tokenmill.model.quant import Int4Linear, Int8BlockLinear, Q5BlockLinear
    from tokenmill.model.safetensors_loader import HFCheckpoint

    torch.manual_seed(1)
    hf = transformers.Qwen2Config(hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                  max_position_embeddings=256, rms_norm_eps=1e-6)
    transformers.Qwen2ForCausalLM(hf).save_pretrained(tmp_path, safe_serialization=True)
    ckpt = HFCheckpoint(str(tmp_path))
    cfg = ckpt.model_config()
    weights = dict(ckpt.iter_state_dict(cfg))
    stored = StoredBlocks({}, {}, set())
    for name, w in list(weights.items()):
        if not name.startswith("model.layers.") or w.dim() != 2:
            continue
        wide = name.endswith("layers.0.self_attn.v_proj.weight") or name.endswith("layers.1.mlp.down_proj.weight")
        raw = quants.quantize(w.numpy(), G.Q8_0 if wide else G.Q5_0)
        weights[name] = torch.from_numpy(quants.dequantize(raw, G.Q8_0 if wide else G.Q5_0).copy())
        if wide:
            stored.wide.add(name)
        else:
            stored.q5_0[name] = tuple(torch.from_numpy(a) for a in q5_0_codes(raw, *w.shape))
    model = build_model(cfg, dict(weights), torch.bfloat16, None, "int4", stored)
    l0, l1 = model.layers
    assert isinstance(l0.qkv, Int8BlockLinear) and isinstance(l1.qkv, Q5BlockLinear)
    assert isinstance(l1.down, Int8BlockLinear) and isinstance(l0.down, Q5BlockLinear)
    assert torch.equal(l1.gate_up.dequantize(), torch.cat([weights["model.layers.1.mlp.gate_proj.weight"],
                                                           weights["model.layers.1.mlp.up_proj.weight"]]))
    # without the file's blocks the same weights are rounded to int4
    assert isinstance(build_model(cfg, dict(weights), torch.bfloat16, None, "int4").layers[1].qkv, Int4Linear)
    loaded = LoadedModel(model, None, cfg, "q5")
    results = {}
    # both activation levels (loader.set_activation_levels): one level is its own tile kinds
    for levels, kinds in ((2, (3, 4)), (1, (5, 6))):
        set_activation_levels(model, levels)
        assert (l0.qkv.tile_kind, l1.qkv.tile_kind) == kinds
        results[levels] = _greedy_fused_and_not(loaded, "model")
        assert results[levels][True] == results[levels][False]
    assert results[1][True][1] != results[2][True][1]  # one level rounds the inputs more coarsely
    for levels in (1, 2):
        tokens, logprobs = results[levels][True]
        assert len({t for ts in tokens.values() for t in ts}) > 3  # not one token over and over
        assert np.isfinite([lp for lps in logprobs.values() for lp, _ in lps]).all()
