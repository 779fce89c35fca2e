"""Native decode kernels against plain-torch references: the fused decode attention
(writes K/V, attends over the paged cache), silu*mul, and the int8-activation
quantized matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.kernels import native_ops
from tokenmill.model.quant import GROUP, Int4Linear, Int8BlockLinear, Int8Linear, output_projection

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ toolchain: the torch paths are the only ones")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (10, 2, 80), (4, 4, 128)])
# one token; a partial block; several chunks to merge. Alone, one sequence is cut in
# short chunks that the threads share by cost.
@pytest.mark.parametrize("lens", [[1, 17, 300, 700], [641]])
def test_decode_attention_matches_reference(dtype, H, Hkv, D, lens):
    if not ops.decode_attention_available():
        pytest.skip("decode_attention needs AVX-512")
    bs = 16
    B = len(lens)
    nblocks = [-(-n // bs) for n in lens]
    num_slots = (sum(nblocks) + 4) * bs
    k_cache = torch.randn(Hkv, num_slots, D, generator=_gen(1)).to(dtype)
    v_cache = torch.randn(Hkv, num_slots, D, generator=_gen(2)).to(dtype)
    perm = torch.randperm(num_slots // bs, generator=_gen(3))  # scattered blocks
    tables = torch.zeros(B, max(nblocks), dtype=torch.int64)
    used = 0
    for b, nb in enumerate(nblocks):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    seq_lens = torch.tensor(lens)
    pos = seq_lens - 1
    slots = tables[torch.arange(B), pos // bs] * bs + pos % bs
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=_gen(4)).to(dtype)
    scale = D ** -0.5
    out = ops.decode_attention(qkv, k_cache, v_cache, slots, tables, seq_lens, H, Hkv, bs, scale)
    assert out.shape == (B, H * D) and out.dtype == dtype
    g = H // Hkv
    for b, n in enumerate(lens):
        k_new = qkv[b, H * D:(H + Hkv) * D].view(Hkv, D)
        v_new = qkv[b, (H + Hkv) * D:].view(Hkv, D)
        assert torch.equal(k_cache[:, slots[b]], k_new) and torch.equal(v_cache[:, slots[b]], v_new)
        ctx = tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs
        k = k_cache[:, ctx].float().repeat_interleave(g, dim=0)  # [H, n, D]
        v = v_cache[:, ctx].float().repeat_interleave(g, dim=0)
        q = qkv[b, :H * D].view(H, 1, D).float()
        want = (torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1) @ v).view(H * D)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out[b].float(), want, atol=tol, rtol=tol), (b, n)


def test_decode_attention_rejects_empty_sequences_and_bad_slots():
    if not ops.decode_attention_available():
        pytest.skip("decode_attention needs AVX-512")
    H, Hkv, D, bs = 4, 2, 64, 16
    cache = torch.zeros(Hkv, 4 * bs, D)
    qkv = torch.randn(3, (H + 2 * Hkv) * D)
    tables = torch.tensor([[0], [1], [2]])
    slots = torch.tensor([4, 16, 38])
    ops.decode_attention(qkv, cache, cache.clone(), slots, tables, torch.tensor([5, 1, 7]), H, Hkv, bs, 0.125)
    for lens, sl in ((torch.tensor([5, 0, 7]), slots), (torch.tensor([5, 1, 17]), slots),
                     (torch.tensor([5, 1, 7]), torch.tensor([4, 16, 4 * bs]))):
        with pytest.raises(RuntimeError, match="slot or length out of range"):
            ops.decode_attention(qkv, cache, cache.clone(), sl, tables, lens, H, Hkv, bs, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 40])  # 40: a tail past the 16-lane loop
def test_silu_mul(dtype, inter):
    gu = (3 * torch.randn(5, 2 * inter, generator=_gen(0))).to(dtype)
    g, u = gu.float().chunk(2, dim=-1)
    want = F.silu(g) * u
    got = ops.silu_mul(gu)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)


def _quantized_activations(x):
    """The kernels' activation rounding: int8 per 16 inputs, scale max|x| / 127."""
    m, k = x.shape
    g = x.float().view(m, k // 16, 16)
    d = g.abs().amax(-1, keepdim=True) / 127
    q = torch.round(g * torch.where(d > 0, 1 / d, 0))
    return (q * d).view(m, k), x.float().view(m, k // GROUP, GROUP).sum(-1)


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_int4_kernel_matches_its_definition(rows):
    lin = Int4Linear(torch.randn(96, 320, generator=_gen(0)) * 0.05)
    if lin._vnni is None:
        pytest.skip("no AVX-512 VNNI or AVX2: torch's packed kernel runs instead")
    x = torch.randn(rows, 320, generator=_gen(rows)).to(torch.bfloat16)
    xa, sums = _quantized_activations(x)
    # w = q * d + m: the q*d part meets the rounded activations, m the exact group sums
    qd = (lin.codes().view(96, -1, GROUP).float() * lin.d.float()[..., None]).view(96, 320)
    want = xa @ qd.T + sums @ lin.m.float().T
    got = lin._vnni.q4_gemv(x, lin.tiles, True, False)
    # exact but for rare rounding ties of an activation (x * (1/d) vs torch's order)
    assert (got - want).norm() / want.norm() < 3e-3
    # the bf16 entry point rounds the same numbers
    assert torch.allclose(lin(x).float(), got, rtol=1e-2, atol=1e-2 * got.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_kernel_matches_its_definition(rows):
    lin = Int8Linear(torch.randn(48, 256, generator=_gen(0)), float_out=True)
    if lin._vnni is None:
        pytest.skip("no AVX-512 VNNI or AVX2")
    x = torch.randn(rows, 256, generator=_gen(rows)).to(torch.bfloat16)
    xa, _ = _quantized_activations(x)
    want = xa @ lin.dequantize().T
    got = lin(x)
    assert got.dtype == torch.float32
    assert (got - want).norm() / want.norm() < 3e-3


def _q8_0_tensor(g, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dequantized Q8_0 tensor [n, k] and its float16 scales [n, k / 32]."""
    d = (torch.rand(n, k // GROUP, generator=g) * 0.01 + 1e-3).to(torch.float16)
    q = torch.randint(-127, 128, (n, k // GROUP, GROUP), generator=g)
    q[:, :, 5] = 127  # Q8_0 scales by the block's largest magnitude, so one code is +-127
    q[::2, :, 5] = -127
    return (q.float() * d.float()[..., None]).view(n, k), d


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_int8_block_head_keeps_q8_0_blocks_and_near_exact_logits(rows):
    """The output projection reads a Q8_0 tensor's own codes and scales (nothing rounded a
    second time) and takes its inputs in two int8 levels: logits within 1e-4 of the float
    product, far closer than per-row int8 gets."""
    if ops.quant_gemv_vnni() is False:
        pytest.skip("no AVX-512 VNNI or AVX2")
    n, k = 64, 256
    w, d = _q8_0_tensor(_gen(0), n, k)
    lin = output_projection(w)
    assert isinstance(lin, Int8BlockLinear)
    assert torch.equal(lin.d, d)
    x = torch.randn(rows, k, generator=_gen(rows))
    x[:, 9] = 30.0  # an outlier channel
    exact = x @ w.T
    got = lin(x)
    assert got.dtype == torch.float32
    assert ((got - exact).norm() / exact.norm()).item() < 1e-4
    per_row = Int8Linear(w, float_out=True)(x)
    assert (per_row - exact).norm() > 10 * (got - exact).norm()
    # bf16 inputs: the same kernel on the rounded inputs
    xb = x.to(torch.bfloat16)
    assert ((lin(xb) - xb.float() @ w.T).norm() / exact.norm()).item() < 1e-4


@pytest.mark.parametrize("rows", [1, 6])
def test_one_level_block_kernels_match_their_definition(rows):
    """int8 blocks (Q8_0 grid) and Q5_0 blocks with their inputs in one int8 level
    (loader.set_activation_levels(model, 1)): the rounded activations against the
    blocks' own weights."""
    if ops.quant_gemv_vnni() is False:
        pytest.skip("no AVX-512 VNNI or AVX2")
    from tokenmill.model.quant import Q5BlockLinear

    g = _gen(2)
    n, k = 48, 256
    w8_weight, d = _q8_0_tensor(g, n, k)
    w8 = Int8BlockLinear(w8_weight, float_out=True, precise=False)
    codes = torch.randint(0, 32, (n, k), generator=g)
    q5 = Q5BlockLinear(codes, d, precise=False)
    assert (w8.tile_kind, q5.tile_kind) == (5, 6)
    x = torch.randn(rows, k, generator=_gen(rows))
    x[:, 9] = 30.0  # an outlier channel: one level's rounding shows
    xa, sums = _quantized_activations(x)
    # Q5_0 as int4's tiles take it: q * d meets the rounded inputs, m = -16 d the exact sums
    qd = (codes.view(n, -1, GROUP).float() * d.float()[..., None]).view(n, k)
    for lin, weight, got, want in ((w8, w8_weight, w8(x), xa @ w8_weight.T),
                                   (q5, q5.dequantize(), q5(x).float(), xa @ qd.T - 16 * sums @ d.float().T)):
        exact = x @ weight.T
        tol = 3e-3 if lin is w8 else 1e-2  # (Q5_0's output is bfloat16)
        assert (got - want).norm() / want.norm() < tol
        assert (got - exact).norm() / exact.norm() > 1e-4  # not the two-level product


def test_int4_precise_mode_is_near_exact_activations():
    w = torch.randn(64, 256, generator=_gen(0)) * 0.05
    one, two = Int4Linear(w), Int4Linear(w, precise=True)
    if one._vnni is None:
        pytest.skip("no AVX-512 VNNI or AVX2")
    x = torch.randn(2, 256, generator=_gen(1))
    x[:, 7] = 40.0  # an outlier channel, as a norm's output has
    exact = x @ one.dequantize().T
    err = {lin.precise: (lin._vnni.q4_gemv(x, lin.tiles, True, lin.precise) - exact).norm() / exact.norm()
           for lin in (one, two)}
    assert err[True] < 1e-4 < err[False]


@pytest.mark.parametrize("precise", [False, True])
def test_int4_kernel_with_zero_and_outlier_groups(precise):
    # an all-zero group of 16 inputs (its scale is 0) and an outlier channel, from float32
    # and bfloat16 input; one level of int8 activations is exact to its own rounding,
    # two levels to the float activations
    lin = Int4Linear(torch.randn(64, 256, generator=_gen(0)) * 0.05, precise=precise)
    if lin._vnni is None:
        pytest.skip("no AVX-512 VNNI or AVX2")
    x = torch.randn(3, 256, generator=_gen(1))
    x[:, :16] = 0.0
    x[1, 40] = 60.0
    qd = (lin.codes().view(64, -1, GROUP).float() * lin.d.float()[..., None]).view(64, 256)
    for inp in (x, x.to(torch.bfloat16)):
        got = lin._vnni.q4_gemv(inp, lin.tiles, True, precise)
        if precise:
            want = inp.float() @ lin.dequantize().T
        else:
            xa, sums = _quantized_activations(inp)
            want = xa @ qd.T + sums @ lin.m.float().T
        assert torch.isfinite(got).all()
        assert (got - want).norm() / want.norm() < (1e-4 if precise else 3e-3)
