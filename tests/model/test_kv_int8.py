"""The int8 KV cache (CacheConfig.kv_cache_dtype="int8"): one quantizer for every writer,
native attention over int8 rows against a torch reference over the dequantized cache,
and models and engines that give the same results whichever path fills or reads it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import full_logits, make_engine, run_to_completion, tiny_loaded
from tokenmill.config import CacheConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.kv.cache import KVCache
from tokenmill.model.attention import dequantize_kv, quantize_kv
from tokenmill.model.kernels import native_ops

ops = native_ops()
native = pytest.mark.skipif(ops is None or not ops.decode_attention_available(),
                            reason="the native decode kernels need a C++ toolchain and AVX-512")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_quantize_kv_rounds_each_row_to_its_own_scale():
    x = torch.randn(5, 3, 64, generator=_gen(0)) * torch.tensor([1e-3, 1.0, 40.0]).view(1, 3, 1)
    x[2, 1] = 0  # an all-zero row: scale 0, no division by it
    q, d = quantize_kv(x)
    assert q.dtype == torch.int8 and d.dtype == torch.float32 and d.shape == (5, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert d[2, 1] == 0 and not q[2, 1].any()
    err = (dequantize_kv(q, d, torch.float32) - x).abs()
    assert bool((err <= d.unsqueeze(-1) / 2 * (1 + 1e-5)).all())
    # a row's largest entry lands on +-127 exactly
    assert torch.equal(q.abs().amax(-1)[d > 0], torch.full_like(q[..., 0][d > 0], 127))


def test_cache_layout_and_bytes():
    c = KVCache(2, 3, 4, 16, 64, torch.bfloat16, torch.int8)
    assert c.quantized and c.data.dtype == torch.int8 and c.scales.shape == (2, 2, 3, 64)
    k, v = c.layer(1)
    ks, vs = c.layer_scales(1)
    assert k.shape == (3, 64, 64) and ks.shape == (3, 64) and vs.data_ptr() != ks.data_ptr()
    assert KVCache(2, 3, 4, 16, 64, torch.bfloat16).layer_scales(0) == (None, None)
    bf16 = KVCache.bytes_per_block(30, 3, 16, 64, torch.bfloat16)
    int8 = KVCache.bytes_per_block(30, 3, 16, 64, torch.int8)
    assert int8 == bf16 // 2 + 30 * 2 * 3 * 16 * 4  # the rows' bytes halve; a float scale a row
    with pytest.raises(ValueError, match="the model's dtype or int8"):
        KVCache(2, 3, 4, 16, 64, torch.bfloat16, torch.float16)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        CacheConfig(kv_cache_dtype="fp8")


def _paged_int8(Hkv, D, lens, bs=16, seed=1):
    """A scattered int8 cache holding random keys and values for sequences of `lens`."""
    nblocks = [-(-n // bs) for n in lens]
    num_slots = (sum(nblocks) + 4) * bs
    kq, ks = quantize_kv(torch.randn(num_slots, Hkv, D, generator=_gen(seed)))
    vq, vs = quantize_kv(torch.randn(num_slots, Hkv, D, generator=_gen(seed + 1)) * 3)
    cache = [t.transpose(0, 1).contiguous() for t in (kq, vq, ks, vs)]
    perm = torch.randperm(num_slots // bs, generator=_gen(seed + 2))
    tables = torch.zeros(len(lens), max(nblocks), dtype=torch.int64)
    used = 0
    for b, nb in enumerate(nblocks):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    return cache, tables


def _reference(q, k, v, ks, vs, ctx, g, scale, causal_from=None):
    """Attention of q [n, H, D] over the dequantized slots `ctx` (float32)."""
    kd = dequantize_kv(k[:, ctx], ks[:, ctx], torch.float32).repeat_interleave(g, dim=0)  # [H, L, D]
    vd = dequantize_kv(v[:, ctx], vs[:, ctx], torch.float32).repeat_interleave(g, dim=0)
    scores = q.float().transpose(0, 1) @ kd.transpose(1, 2) * scale  # [H, n, L]
    if causal_from is not None:
        n, L = q.shape[0], len(ctx)
        hidden = torch.arange(L).view(1, L) > (causal_from + torch.arange(n)).view(n, 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vd).transpose(0, 1)  # [n, H, D]


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (10, 2, 80), (4, 4, 128)])
@pytest.mark.parametrize("lens", [[1, 17, 300, 700], [641]])
def test_decode_attention_over_int8_matches_reference(dtype, H, Hkv, D, lens):
    bs = 16
    (k_cache, v_cache, k_scale, v_scale), tables = _paged_int8(Hkv, D, lens, bs)
    B = len(lens)
    seq_lens = torch.tensor(lens)
    pos = seq_lens - 1
    slots = tables[torch.arange(B), pos // bs] * bs + pos % bs
    qkv = (torch.randn(B, (H + 2 * Hkv) * D, generator=_gen(4)) * 2).to(dtype)
    scale = D ** -0.5
    out = ops.decode_attention(qkv, k_cache, v_cache, slots, tables, seq_lens, H, Hkv, bs, scale,
                               k_scale, v_scale)
    assert out.shape == (B, H * D) and out.dtype == dtype
    g = H // Hkv
    for b, n in enumerate(lens):
        # the new token went in as torch's quantizer writes it, byte for byte
        want_k = quantize_kv(qkv[b, H * D:(H + Hkv) * D].view(Hkv, D))
        want_v = quantize_kv(qkv[b, (H + Hkv) * D:].view(Hkv, D))
        assert torch.equal(k_cache[:, slots[b]], want_k[0]) and torch.equal(k_scale[:, slots[b]], want_k[1])
        assert torch.equal(v_cache[:, slots[b]], want_v[0]) and torch.equal(v_scale[:, slots[b]], want_v[1])
        ctx = tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs
        q = qkv[b, :H * D].view(1, H, D)
        want = _reference(q, k_cache, v_cache, k_scale, v_scale, ctx, g, scale).reshape(H * D)
        # keys meet a query rounded to ~15 bits, values weights rounded to int16 against
        # their largest; bf16: its output rounding too
        tol = 1e-3 if dtype == torch.float32 else 1.5e-2
        assert torch.allclose(out[b].float(), want, atol=tol, rtol=tol), (b, n, (out[b].float() - want).abs().max())


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_over_int8_matches_reference(dtype):
    """Short prefill chunks after cached context read int8 rows through the block table."""
    H, Hkv, D, bs = 9, 3, 64, 16
    (k_cache, v_cache, k_scale, v_scale), tables = _paged_int8(Hkv, D, [75], bs, seed=7)
    n = 5
    q = (torch.randn(n, H, D, generator=_gen(9)) * 2).to(dtype)
    out = ops.paged_attention(q, k_cache, v_cache, tables, torch.tensor([75]), torch.tensor([0, n]), bs,
                              0.125, k_scale, v_scale)
    ctx = tables[0, torch.arange(75) // bs] * bs + torch.arange(75) % bs
    want = _reference(q, k_cache, v_cache, k_scale, v_scale, ctx, H // Hkv, 0.125, causal_from=75 - n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), want, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="needs its k and v scales"):
        ops.paged_attention(q, k_cache, v_cache, tables, torch.tensor([75]), torch.tensor([0, n]), bs, 0.125)
    with pytest.raises(RuntimeError, match="float32 \\[kv_heads, slots\\]"):
        ops.paged_attention(q, k_cache, v_cache, tables, torch.tensor([75]), torch.tensor([0, n]), bs, 0.125,
                            k_scale[:, :16].contiguous(), v_scale)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=native)])
def test_model_over_int8_cache_gives_the_same_logits_in_any_chunking(kernel):
    """Every path attends over what the cache holds (a chunk's own keys included), so a
    prompt in one chunk, in chunks after cached context, or token by token (decode) gives
    the same logits up to float rounding (which an int8 rounding step can enlarge) and the
    native kernels' approximations (a ~15-bit query for the keys, 16-bit value weights)."""
    loaded = tiny_loaded(layers=2, hidden=256, heads=4, kv_heads=2)  # head_dim 64: the native kernels
    model = loaded.model
    ids = torch.randint(1, 300, (40,), generator=_gen(3)).tolist()
    k = ops if kernel else None
    whole = full_logits(model, ids, None, torch.int8, k)
    scale = float(whole.abs().max())
    for chunk in (7, 1):
        diff = float((full_logits(model, ids, chunk, torch.int8, k) - whole).abs().max())
        assert diff <= 5e-3 * scale, (chunk, diff, scale)
    # it did quantize (this random model's logits move a lot with its keys: no closeness asked)
    assert not torch.allclose(whole, full_logits(model, ids, None, None, k), atol=1e-2 * scale)


@native
def test_engine_with_int8_cache_int4_model(smol_int4):
    """The default quantized model on an int8 cache: native bursts equal one step at a
    time, a prefix-cache hit equals a miss, and the same memory holds ~1.9x the blocks."""
    prompts = {"a": [1, 504, 3458, 282, 4649, 314] * 6, "b": [1, 2683, 253, 1345, 563, 260, 3185, 30]}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for steps in (1, 8):
        engine = make_engine(smol_int4, num_blocks=64, decode_steps=steps, kv_cache_dtype="int8")
        assert engine.kv_cache.quantized
        runs[steps] = run_to_completion(engine, {r: (p, params) for r, p in prompts.items()})[0]
        # the same prompt again: its blocks come from the prefix cache
        again = run_to_completion(engine, {"a2": (prompts["a"], params)})[0]
        assert again["a2"] == runs[steps]["a"]
    assert runs[1] == runs[8]
    base = make_engine(smol_int4, num_blocks=64, kv_cache_dtype="auto")
    exact = run_to_completion(base, {r: (p, params) for r, p in prompts.items()})[0]
    # a greedy continuation may part ways once an int8 rounding flips a near tie; the start holds
    assert all(exact[r][0][:4] == runs[8][r][0][:4] for r in prompts)
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    sized = {dt: LLMEngine(smol_int4, EngineConfig(cache=CacheConfig(kv_cache_gb=0.01, kv_cache_dtype=dt)))
             for dt in ("auto", "int8")}
    ratio = sized["int8"].kv_cache.num_blocks / sized["auto"].kv_cache.num_blocks
    assert 1.85 < ratio < 1.95


def test_serve_refuses_an_unknown_kv_cache_dtype():
    from typer.testing import CliRunner

    from tokenmill.cli import app

    result = CliRunner().invoke(app, ["serve", "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 2
    assert "kv_cache_dtype must be one of auto, int8" in result.output
