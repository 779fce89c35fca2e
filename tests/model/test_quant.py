"""Weight-only quantized linears: every kernel (native VNNI tiles, torch's packed kernels,
native int8 rows) computes the product with the same dequantized weight. (That a row's
result does not depend on the row count: tests/engine/test_determinism.py.)"""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.kernels import native_ops
from tokenmill.model.quant import Int4Linear, Int8Linear


def _weight(n=208, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("rows", [1, 3, 17, 100])
def test_quantized_linear_matches_its_dequantized_weight(cls, rows):
    w = _weight()
    bias = torch.randn(w.shape[0])
    lin = cls(w, bias)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = x.float() @ lin.dequantize().T + bias
    got = lin(x).float()
    assert got.dtype == torch.float32 and got.shape == want.shape
    # bf16 activations and outputs (and, with VNNI, int8-rounded activations): relative
    # error of about a percent
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("cls,max_err", [(Int8Linear, 0.01), (Int4Linear, 0.1)])
def test_quantization_error_is_bounded(cls, max_err):
    w = _weight(k=256)
    err = (cls(w).dequantize() - w).abs().max() / w.abs().max()
    assert 0 < err < max_err


def test_int4_falls_back_to_int8_for_shapes_it_cannot_pack():
    from tokenmill.model.quant import quantize_linear

    assert isinstance(quantize_linear("int4", _weight(n=200), None), Int8Linear)  # N not in 16s
    assert isinstance(quantize_linear("int4", _weight(k=48), None), Int8Linear)  # K not in 32s
    assert isinstance(quantize_linear("int4", _weight(), None), Int4Linear)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linear("int3", _weight(), None)


def test_native_int8_gemv_matches_reference():
    ops = native_ops()
    if ops is None:
        pytest.skip("no C++ toolchain: torch's packed kernel is the only path")
    lin = Int8Linear(_weight(n=1000, k=200))  # K not a multiple of 16: the tail loop runs
    for rows in (1, 2, 5):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = x.float() @ lin.dequantize().T
        got = ops.int8_gemv(x, lin.qweight, lin.scales)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_without_vnni_torch_kernels_compute_the_same_weights(cls, monkeypatch):
    from tokenmill.model import quant

    monkeypatch.setattr(quant, "_vnni_ops", lambda: None)  # a CPU without AVX-512 VNNI
    w = _weight()
    lin = cls(w)
    assert lin._vnni is None
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = x.float() @ lin.dequantize().T
    assert torch.allclose(lin(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_int4_codes_come_back_from_the_tiles():
    """With the VNNI tiles the codes are kept only inside them (a byte a weight saved)."""
    from tokenmill.model.quant import pack_int4_tiles, unpack_int4_tiles

    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (48, 96), generator=g, dtype=torch.uint8)
    d = torch.rand(48, 3, generator=g).to(torch.float16)
    m = torch.rand(48, 3, generator=g).to(torch.float16)
    assert torch.equal(unpack_int4_tiles(pack_int4_tiles(q, d, m), 48, 96), q)
    lin = Int4Linear(_weight(n=48, k=96))
    if lin._vnni is not None:
        assert lin._q is None
    assert lin.codes().shape == (48, 96) and int(lin.codes().max()) <= 15


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_keeps_a_gguf_files_own_blocks(qtype):
    """A Q4_0 or Q4_1 tensor (quantized by the gguf package's reference code) comes back
    from Int4Linear as it was: its codes are recovered, not rounded a second time."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    t = getattr(GGMLQuantizationType, qtype)
    w = _weight(n=64, k=256, seed=3).numpy()
    w[:, ::7] *= -3.0  # some groups with a negative extreme, some with a positive one
    stored = quants.dequantize(quants.quantize(w, t), t)
    got = Int4Linear(torch.from_numpy(stored)).dequantize().numpy()
    np.testing.assert_array_equal(got, stored)
    # the old min/max grid alone does not reproduce Q4_0: the test can fail
    if qtype == "Q4_0":
        g = torch.from_numpy(stored).view(64, -1, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        d = ((hi - lo) / 15).to(torch.float16).float()[..., None]
        q = ((g - lo.to(torch.float16).float()[..., None]) / d).round().clamp(0, 15)
        assert (q * d + lo.to(torch.float16).float()[..., None] - g).abs().max() > 1e-3


@pytest.mark.parametrize("precise,vnni", [(False, True), (True, True), (False, False)])
def test_int4_kernels_take_q4_0_blocks_with_either_sign(precise, vnni, monkeypatch):
    """Q4_0 groups whose extreme weight is positive keep a negative scale: every kernel
    (VNNI tiles, precise or not, and torch's) computes with it as with any other."""
    from gguf import GGMLQuantizationType, quants

    from tokenmill.model import quant

    if not vnni:
        monkeypatch.setattr(quant, "_vnni_ops", lambda: None)

    t = GGMLQuantizationType.Q4_0
    w = _weight(n=64, k=256, seed=4).numpy()
    w[::2] *= -1.0
    stored = torch.from_numpy(quants.dequantize(quants.quantize(w, t), t))
    lin = Int4Linear(stored, precise=precise)
    assert (lin.d < 0).any() and (lin.d > 0).any()
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = x.float() @ stored.T
        got = lin(x).float()
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_q4_k_blocks_keep_their_codes_in_int4(tmp_path):
    """A K-quant file's Q4_K blocks (random, written with the gguf package) are kept as
    they are: our grid reproduces gguf's dequantization, and int4 mode stores the file's
    own codes, so its weights differ from the file's only by d and m rounded to float16."""
    import gguf
    import numpy as np

    from tokenmill.model.gguf_loader import GGUFFile
    from tokenmill.model.quant import Int4Linear

    rng = np.random.default_rng(0)
    rows, cols = 32, 512
    nb = rows * cols // 256
    blocks = rng.integers(0, 256, size=(nb, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(nb, 0.01, np.float16).view(np.uint8).reshape(nb, 2)  # d
    blocks[:, 2:4] = np.full(nb, 0.004, np.float16).view(np.uint8).reshape(nb, 2)  # dmin
    path = tmp_path / "q4k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_down.weight", blocks.reshape(rows, cols // 256 * 144),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFFile(str(path))
    ref = gf.dequantize("blk.0.ffn_down.weight")
    q, d, m = gf.int4_grid("blk.0.ffn_down.weight")
    assert q.shape == (rows, cols) and q.max() <= 15
    mine = (q.reshape(rows, -1, 32).astype(np.float32) * d[..., None] + m[..., None]).reshape(rows, cols)
    np.testing.assert_array_equal(mine, ref)  # bit for bit: the same arithmetic as gguf's
    lin = Int4Linear(torch.from_numpy(ref), grid=tuple(torch.from_numpy(a) for a in (q, d, m)))
    assert torch.equal(lin.codes(), torch.from_numpy(q))
    err = (lin.dequantize() - torch.from_numpy(ref)).abs().max().item()
    assert err <= 2e-3 * float(np.abs(ref).max())  # float16 d and m only
    rederived = Int4Linear(torch.from_numpy(ref))  # without the file's grid: rounded a second time
    assert (rederived.dequantize() - torch.from_numpy(ref)).abs().max().item() > err


def test_q5_0_blocks_are_kept_as_the_file_stores_them(tmp_path):
    """A Q5_0 tensor (quantized by the gguf package's reference code, written to a GGUF
    file) comes back with its own codes and scales, bit for bit what gguf dequantizes, in
    Q5_0 tiles (5.5 bits a weight), and the native kernel computes with exactly those
    weights."""
    import gguf
    import numpy as np

    from tokenmill.model.gguf_loader import GGUFFile
    from tokenmill.model.quant import Q5BlockLinear, quant_vnni_available, unpack_q5_tiles

    rows, cols = 48, 256
    w = _weight(n=rows, k=cols, seed=5).numpy()
    w[:, ::5] *= -4.0  # groups with a negative extreme and groups with a positive one
    path = tmp_path / "q5.gguf"
    gw = gguf.GGUFWriter(str(path), "llama")
    gw.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0),
                  raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    gf = GGUFFile(str(path))
    ref = gf.dequantize("blk.0.ffn_up.weight")
    q, d = gf.q5_0_grid("blk.0.ffn_up.weight")
    assert q.shape == (rows, cols) and q.max() == 31 and q.min() == 0 and (d < 0).any() and (d > 0).any()
    mine = ((q.reshape(rows, -1, 32).astype(np.float32) - 16) * d[..., None]).reshape(rows, cols)
    np.testing.assert_array_equal(mine, ref)  # the same arithmetic as gguf's
    if not quant_vnni_available():
        pytest.skip("Q5_0 tiles need the int8-activation kernels (AVX-512 VNNI or AVX2)")
    lin = Q5BlockLinear(torch.from_numpy(q), torch.from_numpy(d))
    assert lin.tiles.numel() == rows * cols * 11 // 16  # 5.5 bits a weight
    assert torch.equal(unpack_q5_tiles(lin.tiles, rows, cols), torch.from_numpy(q))
    stored = torch.from_numpy(ref)
    assert torch.equal(lin.dequantize(), stored)  # no second rounding
    for n in (1, 3, 17):
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        want = x.float() @ stored.T
        got = lin(x).float()
        # two int8 levels of activations (~16 bits) and a bf16 output
        assert torch.allclose(got, want, rtol=1e-2, atol=4e-3 * want.abs().max().item())


def test_auto_keeps_q5_0_and_wide_blocks_and_int4_rounds_them(tmp_path, monkeypatch):
    """`--quantization auto` on a file of Q5_0 layers with a Q8_0 part keeps them (Q5_0
    tiles; 8-bit blocks where a layer has the Q8_0 part); an explicit `int4` rounds every
    layer to 4 bits, as it says, and the two are prepared and cached apart."""
    import gguf
    import numpy as np

    from tokenmill.model.loader import load_model
    from tokenmill.model.quant import Int4Linear, Int8BlockLinear, Q5BlockLinear, quant_vnni_available

    if not quant_vnni_available():
        pytest.skip("Q5_0 tiles need the int8-activation kernels (AVX-512 VNNI or AVX2)")
    monkeypatch.setenv("TOKENMILL_PREPARED_DIR", str(tmp_path / "prepared"))
    G = gguf.GGMLQuantizationType
    hidden, ffn, vocab = 256, 512, 16
    rng = np.random.default_rng(0)
    path = tmp_path / "q5-model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(vocab)])

    def add(name, rows, cols, qtype=G.Q5_0):
        x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", vocab, hidden, G.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    add("blk.0.attn_q.weight", hidden, hidden)
    add("blk.0.attn_k.weight", 128, hidden)
    add("blk.0.attn_v.weight", 128, hidden, G.Q8_0)
    add("blk.0.attn_output.weight", hidden, hidden)
    add("blk.0.ffn_gate.weight", ffn, hidden)
    add("blk.0.ffn_up.weight", ffn, hidden)
    add("blk.0.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    auto = load_model(str(path), "bfloat16", "auto").model.layers[0]
    assert isinstance(auto.qkv, Int8BlockLinear)  # q, k Q5_0 and v Q8_0: 8 bits
    assert all(isinstance(lin, Q5BlockLinear) for lin in (auto.o_proj, auto.gate_up, auto.down))
    int4 = load_model(str(path), "bfloat16", "int4").model.layers[0]
    assert all(isinstance(lin, Int4Linear) for lin in (int4.qkv, int4.o_proj, int4.gate_up, int4.down))
    assert len(list((tmp_path / "prepared").glob("*.pt"))) == 2
    again = load_model(str(path), "bfloat16", "auto").model.layers[0]  # from the cache
    assert isinstance(again.o_proj, Q5BlockLinear) and torch.equal(again.o_proj.tiles, auto.o_proj.tiles)
    # the activation levels: 2 for a file no recipe installs, 1 on request, from the same cache
    assert (auto.qkv.tile_kind, auto.o_proj.tile_kind, int4.qkv.tile_kind) == (3, 4, 2)
    one = load_model(str(path), "bfloat16", "auto", activation_levels=1)
    assert one.activation_levels == 1 and len(list((tmp_path / "prepared").glob("*.pt"))) == 2
    layer = one.model.layers[0]
    assert (layer.qkv.tile_kind, layer.o_proj.tile_kind, layer.down.tile_kind) == (5, 6, 6)
    assert one.model.lm_head.tile_kind == 3  # the output projection keeps two levels


def test_a_gguf_files_weights_are_made_one_at_a_time(tmp_path):
    """Preparing a model dequantizes each weight when the layer being built asks for it
    (tokenmill/model/lazy_weights.py): names, shapes and membership cost no dequantization,
    and each lookup gives the file's floats (q rows un-permuted as before)."""
    from types import SimpleNamespace

    import gguf
    import numpy as np

    from tokenmill.model.gguf_loader import GGUFFile, _reverse_permute
    from tokenmill.model.lazy_weights import LazyWeights, shape_of

    rng = np.random.default_rng(0)
    path = tmp_path / "lazy.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    q = rng.standard_normal((64, 32)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", q)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(32).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFFile(str(path))
    made = []
    real = gf.dequantize
    gf.dequantize = lambda name: made.append(name) or real(name)
    weights = gf.state_dict(SimpleNamespace(architecture="llama", num_heads=4, num_kv_heads=2))
    assert isinstance(weights, LazyWeights)
    names = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"}
    assert set(weights) == names and "model.layers.0.self_attn.q_proj.weight" in weights
    assert shape_of(weights, "model.layers.0.self_attn.q_proj.weight") == (64, 32)
    assert made == []  # nothing dequantized to answer those
    got = weights["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(got, torch.from_numpy(_reverse_permute(q, 4).copy()))
    assert made == ["blk.0.attn_q.weight"]
    weights["model.layers.0.self_attn.q_proj.weight"]
    assert len(made) == 2  # made afresh, not kept
    assert weights.pop("model.layers.0.input_layernorm.weight") is not None
    assert "model.layers.0.input_layernorm.weight" not in weights and len(made) == 2
