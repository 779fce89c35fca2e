"""Weight-only quantized linears for bfloat16 (or float32) activations.

Decode reads every weight once per step, so on a CPU its speed is the bytes of
weights over memory bandwidth: int8 halves bf16's bytes and int4 quarters them.
Weights are quantized at load time, round-to-nearest:
  int8: symmetric, one scale per output channel;
  int4: asymmetric, groups of 32 along the input, w = q * d + m with float16 d and m:
        GGUF's Q4_1 grid, so a Q4_1 checkpoint's codes are recovered exactly.
Every row count runs the same kernel, whose output rows are each computed the same way
whatever the other rows (the row-invariance that makes a request's tokens independent
of its batch, tests/engine/test_determinism.py): where the CPU has AVX-512 VNNI (or
AVX2, the same integer dots in 8-lane halves) the native kernels of csrc/quant_gemv.cpp, which quantize the activations to int8 per group
of 16 on the fly, as llama.cpp does, and take integer dot products; that keeps up with
memory (torch's packed kernels, the fallback, unpack to floats and run at half that
speed). The cost is the activation rounding, measured by benchmarks/quality.py
--decode-kernels. A dense bf16 copy of the dequantized weight was used from a few dozen
rows on (prefill) until it showed that a row's result then depended on how many rows
shared the matmul; the quantized weights are the only copy now (a 135M model: ~95 MB
instead of ~365 MB). docs/benchmarks.md has what that costs prefill.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.model.kernels import native_ops

GROUP = 32
TILE = 16  # output rows per tile of the native kernels, and torch's int4 packing's unit
_ROWS_AT_ONCE = 8192  # rows quantized together: bounds the float temporaries of a large head
QUANTIZATIONS = ("none", "int8", "int4")


def _vnni_ops() -> Any | None:
    """The native module when its int8-activation kernels were built (AVX-512 VNNI or AVX2;
    "vnni" names them after the first)."""
    ops = native_ops()
    return ops if ops is not None and ops.quant_gemv_vnni() else None


def quant_vnni_available() -> bool:
    """Whether quantized linears pack for the native VNNI kernels (else torch's packing)."""
    return _vnni_ops() is not None


def _tileable(n: int, k: int) -> bool:
    return n % TILE == 0 and k % GROUP == 0


def pack_int4_tiles(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Codes q [N, K] (0..15) and float16 d, m [N, K/32] into q4_gemv's layout
    (csrc/quant_gemv.cpp): per tile of 16 rows, per group of 32 inputs, 4 chunks of
    16 rows x 4 bytes (low nibbles inputs 4c..4c+3, high nibbles 16+4c..16+4c+3), then
    the 16 rows' d and m: 320 bytes a group."""
    n, k = q.shape
    t, g = n // TILE, k // GROUP
    v = q.view(t, TILE, g, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # tile, group, chunk, row, byte, nibble
    codes = (v[..., 0] | (v[..., 1] << 4)).reshape(t, g, 256)
    dm = torch.stack([d.view(t, TILE, g).transpose(1, 2), m.view(t, TILE, g).transpose(1, 2)], dim=2)
    dm = dm.contiguous().view(torch.uint8).view(t, g, 4 * TILE)
    return torch.cat([codes, dm], dim=-1).view(t, g * 320)


def unpack_int4_tiles(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_int4_tiles' codes back: uint8 [N, K]."""
    t, g = n // TILE, k // GROUP
    v = tiles.reshape(t, g, 320)[:, :, :256].reshape(t, g, 4, TILE, 4)  # tile, group, chunk, row, byte
    nib = torch.stack([v & 0x0F, v >> 4], dim=-1)  # ..., nibble
    return nib.permute(0, 3, 1, 5, 2, 4).reshape(n, k).contiguous()


def pack_int8_tiles(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and float32 row scales into q8_gemv's layout: per tile of 16
    rows, the 16 scales, then per group of 32 inputs 8 chunks of 16 rows x 4 inputs,
    as q + 128 in bytes."""
    n, k = q.shape
    t = n // TILE
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    codes = u.view(t, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, -1)
    return torch.cat([scales.float().contiguous().view(torch.uint8).view(t, 4 * TILE), codes], dim=-1)


def pack_int8_blocks(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and float16 scales [N, K/32] into q8b_gemv's layout: per tile of
    16 rows, per group of 32 inputs the codes as in pack_int8_tiles (q + 128), then the 16
    rows' scales: 544 bytes a group."""
    n, k = q.shape
    t, g = n // TILE, k // GROUP
    u = q.view(torch.uint8) ^ 0x80  # q + 128 (two's complement), with no int16 copy of a large head
    codes = u.view(t, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 512)
    ds = d.view(t, TILE, g).transpose(1, 2).contiguous().view(torch.uint8).view(t, g, 2 * TILE)
    return torch.cat([codes, ds], dim=-1).view(t, g * 544)


def pack_q5_tiles(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q5_0 codes q [N, K] (0..31, w = (q - 16) * d) and float16 d [N, K/32] into q5_gemv's
    layout (csrc/quant_gemv.cpp): per tile and group, the low 4 bits as pack_int4_tiles'
    256 bytes, then per chunk the fifth bits as two 64-bit planes (the low nibbles' codes,
    then the high ones'; bit i for byte i of the chunk), then the 16 rows' d: 352 bytes."""
    n, k = q.shape
    t, g = n // TILE, k // GROUP
    q = q.to(torch.uint8)
    v = q.view(t, TILE, g, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # tile, group, chunk, row, byte, nibble
    low = v & 0x0F
    codes = (low[..., 0] | (low[..., 1] << 4)).reshape(t, g, 256)
    bits = (v >> 4).permute(0, 1, 2, 5, 3, 4).reshape(t, g, 4, 2, 8, 8)  # ..., plane, byte of the plane, bit
    planes = (bits.to(torch.int32) << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8).reshape(t, g, 64)
    ds = d.to(torch.float16).view(t, TILE, g).transpose(1, 2).contiguous().view(torch.uint8).view(t, g, 2 * TILE)
    return torch.cat([codes, planes, ds], dim=-1).view(t, g * 352)


def unpack_q5_tiles(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_q5_tiles' codes back: uint8 [N, K] (0..31)."""
    t, g = n // TILE, k // GROUP
    grp = tiles.reshape(t, g, 352)
    v = grp[:, :, :256].reshape(t, g, 4, TILE, 4)  # tile, group, chunk, row, byte
    low = torch.stack([v & 0x0F, v >> 4], dim=-1)  # ..., nibble
    planes = grp[:, :, 256:320].reshape(t, g, 4, 2, 8, 1)
    bits = ((planes >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(t, g, 4, 2, TILE, 4)  # ..., plane, row, byte
    high = bits.permute(0, 1, 2, 4, 5, 3)  # tile, group, chunk, row, byte, plane (= nibble)
    return (low | (high << 4)).permute(0, 3, 1, 5, 2, 4).reshape(n, k).contiguous()


class _Quantized:
    """Shared by both widths: one kernel for every row count (see the module's doc)."""
    bias: torch.Tensor | None
    _vnni: Any

    # Pickled into the prepared-weights cache (tokenmill/model/prepared.py): the native
    # module is looked up again on load rather than pickled.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_vnni"] = self._vnni is not None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._vnni = _vnni_ops() if state["_vnni"] else None

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._packed_mm(x)
        return y + self.bias if self.bias is not None else y


class _Leveled(_Quantized):
    """A kind of tiles whose inputs take one int8 level or (precise) two
    (loader.set_activation_levels switches them)."""
    _KINDS: tuple[int, int]  # csrc/quant_tiles.h's tile kinds: (one level, two)
    precise: bool

    @property
    def tile_kind(self) -> int:
        """The kind the fused decode step runs these tiles as."""
        return self._KINDS[self.precise]


class Int8Linear(_Quantized):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False):
        w = weight.float()
        self.scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.qweight = (w / self.scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scales_bf16 = self.scales.to(torch.bfloat16)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self.out_features, self.in_features = w.shape
        # For the output projection the kernels' float32 result is kept as the logits:
        # rounded to bf16 (steps of 0.125 near 20) top logits tie and greedy errs.
        self.float_out = float_out
        self._vnni = _vnni_ops() if _tileable(*w.shape) else None
        self.tiles = pack_int8_tiles(self.qweight, self.scales) if self._vnni is not None else None

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self._vnni is not None:
            return self._vnni.q8_gemv(x, self.tiles, self.float_out)
        if self.float_out:
            # Without VNNI the output projection takes float FMAs on the int8 weight for
            # every row count: float32 logits, and one row reads the weight 1.4x faster
            # than torch's packed kernel (2.2 vs 3.1 ms); from ~16 rows that is 2x slower
            # (rows: the sequences of a step, or prompt logprobs).
            ops = native_ops()
            if ops is not None:
                return ops.int8_gemv(x, self.qweight, self.scales)
        return torch._weight_int8pack_mm(x, self.qweight, self.scales_bf16)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes a small-batch step reads."""
        return self.tiles.nbytes if self._vnni is not None else self.qweight.nbytes + self.scales_bf16.nbytes


class Int8BlockLinear(_Leveled):
    """The output projection, and the int8 mode's layers: int8 codes with a float16 scale per 32 inputs of a row, as
    GGUF's Q8_0 stores them (d = max|w| / 127 in float16, q = round(w / d)), so a Q8_0
    head's codes and scales come back exactly from its dequantized weights, and its
    inputs in two int8 levels: float32 logits within ~1e-4 of the float product. Per-row
    int8 there (a second rounding of the file's Q8_0 weights, one level of activations)
    changed greedy answers most of all (benchmarks/fidelity.py). Needs the VNNI kernels;
    without them Int8Linear serves (output_projection, quantize_linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = True,
                 precise: bool = True):
        w = weight.float()
        n, k = w.shape
        if not _tileable(n, k):
            raise ValueError(f"int8 blocks need in_features in {GROUP}s and out_features in {TILE}s, got {k}, {n}")
        self._vnni = _vnni_ops()
        if self._vnni is None:
            raise RuntimeError("Int8BlockLinear needs the int8-activation kernels (AVX-512 VNNI or AVX2)")
        g = w.view(n, k // GROUP, GROUP)
        self.d = torch.empty(n, k // GROUP, dtype=torch.float16)
        q = torch.empty(n, k // GROUP, GROUP, dtype=torch.int8)
        # by slices of rows: a 262k-token head's float temporaries, made whole, were ~2 GB
        for r0 in range(0, n, _ROWS_AT_ONCE):
            gs = g[r0:r0 + _ROWS_AT_ONCE]
            ds = (gs.abs().amax(dim=-1) / 127.0).to(torch.float16)
            self.d[r0:r0 + _ROWS_AT_ONCE] = ds
            df = ds.float()[..., None]
            q[r0:r0 + _ROWS_AT_ONCE] = torch.where(df > 0, gs / torch.where(df > 0, df, 1.0), 0.0).round().clamp(
                -127, 127).to(torch.int8)
        self.tiles = pack_int8_blocks(q.view(n, k), self.d)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self.out_features, self.in_features = n, k
        # the output projection keeps float32 logits; a layer's output is in its input's dtype
        self.float_out = float_out
        # precise: inputs in two int8 levels (always for the output projection; a layer's
        # as the model's activation levels say: loader.py)
        self.precise = precise

    _KINDS = (5, 3)  # int8 blocks

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._vnni.q8b_gemv(x, self.tiles, self.float_out, self.precise)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes


class Q5BlockLinear(_Leveled):
    """A layer whose weights a GGUF file stores as Q5_0 (w = (q - 16) * d, q in 0..31, a
    float16 d per 32 inputs), kept as the file has them: 5.5 bits a weight, 10% more than
    int4's tiles, instead of a second rounding to int4. Inputs in two int8 levels
    (precise) or one, as every int4 layer's. Needs the VNNI kernels (AVX-512 VNNI or AVX2)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
                 precise: bool = True):
        n, k = codes.shape
        if not _tileable(n, k):
            raise ValueError(f"Q5_0 blocks need in_features in {GROUP}s and out_features in {TILE}s, got {k}, {n}")
        self._vnni = _vnni_ops()
        if self._vnni is None:
            raise RuntimeError("Q5BlockLinear needs the int8-activation kernels (AVX-512 VNNI or AVX2)")
        self.d = d.to(torch.float16).reshape(n, k // GROUP)
        self.tiles = pack_q5_tiles(codes.reshape(n, k), self.d)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self.out_features, self.in_features = n, k
        self.precise = precise

    _KINDS = (6, 4)  # Q5_0 blocks

    def dequantize(self) -> torch.Tensor:
        q = unpack_q5_tiles(self.tiles, self.out_features, self.in_features).view(self.out_features, -1, GROUP)
        return ((q.float() - 16.0) * self.d.float()[..., None]).view(self.out_features, self.in_features)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._vnni.q5_gemv(x, self.tiles, False, self.precise)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes


def output_projection(weight: torch.Tensor) -> "Int8BlockLinear | Int8Linear":
    """The quantized modes' output projection: Q8_0 blocks where the VNNI kernels run, else
    per-row int8 with float32 logits."""
    n, k = weight.shape
    if _vnni_ops() is not None and _tileable(n, k):
        return Int8BlockLinear(weight)
    return Int8Linear(weight, float_out=True)


def _int4_codes(g: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of groups g against float16 d, m, and each group's squared error."""
    df, mf = d.float()[..., None], m.float()[..., None]
    q = ((g - mf) / df).round().clamp(0, 15)
    return q, ((q * df + mf - g) ** 2).sum(dim=-1)


def _int4_grid(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, m, codes) of w = q * d + m for groups g [N, G, 32], d and m in float16 as GGUF's
    Q4_1 stores them. Two grids per group, the one that reproduces it better kept:
    - min/max (d = range / 15, m = min): Q4_1's own, so a Q4_1 file's codes come back exactly;
    - Q4_0's symmetric d * (c - 8): its extreme weight is always -8 d, so |d| = max|w| / 8,
      negative where the extreme is positive (the kernels take either sign), and m = -8 d,
      so a Q4_0 file's codes come back too instead of being rounded a second time."""
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d1 = ((hi - lo) / 15.0).clamp(min=1e-7).to(torch.float16)
    m1 = lo.to(torch.float16)
    q1, e1 = _int4_codes(g, d1, m1)
    d0 = (torch.maximum(hi, -lo) / 8.0).clamp(min=1e-7)
    d0 = torch.where(-lo >= hi, d0, -d0).to(torch.float16)
    m0 = (-8.0 * d0.float()).to(torch.float16)  # exact: a power of two times d
    q0, e0 = _int4_codes(g, d0, m0)
    take0 = e0 < e1
    d = torch.where(take0, d0, d1)
    m = torch.where(take0, m0, m1)
    q = torch.where(take0[..., None], q0, q1).to(torch.uint8)
    return d, m, q


class Int4Linear(_Leveled):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, precise: bool = False,
                 grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """`grid`: the file's own (codes [N, K], d, m [N, K/32]) where it has them (a K-quant
        file's): kept, with d and m rounded to float16, instead of re-deriving a grid."""
        w = weight.float()
        # precise: the VNNI kernel rounds activations to two int8 levels instead of one
        self.precise = precise
        n, k = w.shape
        if not _tileable(n, k):
            raise ValueError(f"int4 needs in_features in {GROUP}s and out_features in {TILE}s, got {k}, {n}")
        if grid is not None:
            q = grid[0].to(torch.uint8).reshape(n, k)
            self.d, self.m = grid[1].to(torch.float16).reshape(n, k // GROUP), grid[2].to(torch.float16).reshape(
                n, k // GROUP)
        else:
            self.d, self.m, q = _int4_grid(w.view(n, k // GROUP, GROUP))
        q = q.view(n, k)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self.out_features, self.in_features = n, k
        self._vnni = _vnni_ops()
        # the codes themselves only where the tiles do not hold them (a byte a weight: more
        # than the tiles' 0.625)
        self._q: torch.Tensor | None = None
        if self._vnni is not None:
            self.tiles = pack_int4_tiles(q, self.d, self.m)
        else:
            self._q = q
            # torch's kernel computes (q - 8) * scale + zero with bf16 scale and zero
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self.scales_zeros = torch.stack([self.d.float(), self.m.float() + 8.0 * self.d.float()],
                                            dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    _KINDS = (1, 2)  # int4

    def codes(self) -> torch.Tensor:
        """The codes q [N, K] (0..15)."""
        return self._q if self._q is not None else unpack_int4_tiles(self.tiles, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        q = self.codes().view(self.out_features, -1, GROUP).float()
        return (q * self.d.float()[..., None] + self.m.float()[..., None]).view(self.out_features, self.in_features)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self._vnni is not None:
            return self._vnni.q4_gemv(x, self.tiles, False, self.precise)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        """Bytes a small-batch step reads."""
        if self._vnni is not None:
            return self.tiles.nbytes
        return self.packed.nbytes + self.scales_zeros.nbytes


def quantize_linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, precise: bool = False,
                    grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """precise: the layer's inputs in two int8 levels (see Int4Linear; the int8 blocks'
    too). grid: int4 codes and grid to keep (Int4Linear)."""
    if kind == "int8":
        n, k = weight.shape
        if _vnni_ops() is not None and _tileable(n, k):  # Q8_0's grid: a Q8_0 file's own blocks
            return Int8BlockLinear(weight, bias, float_out=False, precise=precise)
        return Int8Linear(weight, bias)
    if kind == "int4":
        n, k = weight.shape
        if not _tileable(n, k):
            # torch's int4 packing needs whole groups along K and N in 16s; a layer of any
            # other shape keeps 8 bits rather than failing the load
            return Int8Linear(weight, bias)
        return Int4Linear(weight, bias, precise=precise, grid=grid)
    raise ValueError(f"unknown quantization {kind!r}; choose one of {QUANTIZATIONS}")
