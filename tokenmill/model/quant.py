"""Weight-only quantized linears on torch's packed CPU kernels (bfloat16 activations).

Decode reads every weight once per step, so on a CPU its speed is the bytes of
weights over memory bandwidth: int8 halves bf16's bytes and int4 quarters them.
Weights are quantized at load time, round-to-nearest:
  int8: symmetric, one scale per output channel;
  int4: asymmetric, groups of 32 along the input (the same grid as GGUF's Q4_1, so a
        Q4_1 checkpoint's 4-bit codes are recovered almost exactly).
The packed kernels only win while the batch is a few rows (measured on the 2-core
target over whole decode steps: int4 beats dense bf16 up to ~16 rows; a lone matmul
whose weight sits in cache suggests 8, but a real step streams every weight from
memory). Larger batches and prefill are compute-bound, so every quantized layer also
keeps its dequantized weight in bf16 and uses it from `dense_from_rows` rows on. That spends memory (a
135M model: 70 MB packed + 270 MB dense) to be fastest at both ends; the quality is
that of the quantized weights either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.kernels import native_ops

GROUP = 32
QUANTIZATIONS = ("none", "int8", "int4")


DENSE_FROM_ROWS = 16


class _Quantized:
    """Shared by both widths: pick the kernel by batch rows."""
    dense: torch.Tensor
    bias: torch.Tensor | None
    dense_from_rows: int

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_from_rows:
            return F.linear(x, self.dense, self.bias)
        y = self._packed_mm(x)
        return y + self.bias if self.bias is not None else y


class Int8Linear(_Quantized):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dense_from_rows: int = DENSE_FROM_ROWS, float_out: bool = False):
        w = weight.float()
        self.scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.qweight = (w / self.scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scales_bf16 = self.scales.to(torch.bfloat16)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self.out_features, self.in_features = w.shape
        self.dense_from_rows = dense_from_rows
        self.dense = self.dequantize().to(torch.bfloat16)
        # For the output projection the one-row kernel's float32 result is kept as the
        # logits: rounded to bf16 (steps of 0.125 near 20) top logits tie and greedy errs.
        self.float_out = float_out

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            # One row (batch-1 decode): the native kernel reads the weight 1.4x faster
            # (an output projection: 2.2 ms vs 3.1 ms on the 2-core target); from two
            # rows on torch's kernel wins.
            ops = native_ops()
            if ops is not None:
                y = ops.int8_gemv(x, self.qweight, self.scales)
                return y if self.float_out else y.to(x.dtype)
        return torch._weight_int8pack_mm(x, self.qweight, self.scales_bf16)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes a small-batch step reads."""
        return self.qweight.nbytes + self.scales_bf16.nbytes


class Int4Linear(_Quantized):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dense_from_rows: int = DENSE_FROM_ROWS):
        w = weight.float()
        n, k = w.shape
        if k % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {k}")
        g = w.view(n, k // GROUP, GROUP)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        # the kernel computes (q - 8) * scale + zero
        zero = lo + 8.0 * scale
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self._q = q.to(torch.uint8)
        self.bias = bias.to(torch.bfloat16) if bias is not None else None
        self.out_features, self.in_features = n, k
        self.dense_from_rows = dense_from_rows
        self.dense = self.dequantize().to(torch.bfloat16)

    def dequantize(self) -> torch.Tensor:
        sz = self.scales_zeros.float()  # [k/G, n, 2]
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # [n, k/G]
        q = self._q.view(self.out_features, -1, GROUP).float()
        return ((q - 8.0) * scale[..., None] + zero[..., None]).view(self.out_features, self.in_features)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        """Bytes a small-batch step reads."""
        return self.packed.nbytes + self.scales_zeros.nbytes


def quantize_linear(kind: str, weight: torch.Tensor, bias: torch.Tensor | None):
    if kind == "int8":
        return Int8Linear(weight, bias)
    if kind == "int4":
        n, k = weight.shape
        if k % GROUP or n % 16:
            # torch's int4 packing needs whole groups along K and N in 16s; a layer of any
            # other shape keeps 8 bits rather than failing the load
            return Int8Linear(weight, bias)
        return Int4Linear(weight, bias)
    raise ValueError(f"unknown quantization {kind!r}; choose one of {QUANTIZATIONS}")
