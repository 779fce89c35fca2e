"""Read a GGUF file: metadata, tensors, dequantization, and llama.cpp's name layout.

Tensors are dequantized with gguf-py's reference routines (the same ones transformers
uses), so our float weights are bit-identical to the reference model's.
"""

from __future__ import annotations

import functools
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from tokenmill.model.config import ModelConfig, ModelLoadError
from tokenmill.model.gguf_reader import GGUFReader
from tokenmill.model.lazy_weights import LazyWeights

try:
    import gguf
except ImportError as exc:  # pragma: no cover - gguf is a pinned dependency
    raise ImportError("the 'gguf' package is required: pip install gguf") from exc

Q = gguf.GGMLQuantizationType
# Quantization types we dequantize; others get a clear error naming the tensor and type.
SUPPORTED_QTYPES = {
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
}

# Quantized types of more than 5 bits a weight other than Q5_0 (which has its own tiles)
WIDE_QTYPES = {Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0}

# llama.cpp tensor names -> Hugging Face Llama names (the names our model uses).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's norms: ffn_norm is the MLP's input norm (transformers' pre_feedforward), and
# two more on the attention's and the MLP's outputs. (llama.cpp stores them as 1 + w.)
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_NAMES_OF = {"gemma3": _GEMMA_LAYER_NAMES}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors llama.cpp writes that carry no weights we need (rope_freqs is handled apart).
_IGNORED = {"rope_freqs.weight"}


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """Our (transformers') name of a llama.cpp tensor in a file of architecture `arch`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _LAYER_NAMES_OF.get(arch, _LAYER_NAMES)
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave (it pairs rotary halves for its RoPE kernel)."""
    rows = w.shape[0]
    head_dim = rows // n_head
    return (
        w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


class GGUFFile:
    """An open GGUF file: metadata as plain Python values, tensors on demand."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise ModelLoadError(f"model file not found: {self.path}")
        if os.path.isdir(self.path):
            raise ModelLoadError(f"expected a .gguf file, got a directory: {self.path}")
        try:
            self.reader = GGUFReader(self.path)
        except Exception as exc:  # a bad file: ValueError, struct.error, UnicodeDecodeError...
            raise ModelLoadError(
                f"{self.path} is not a readable GGUF file (corrupt or truncated: {type(exc).__name__}: {exc})"
            ) from None
        self.metadata: dict[str, Any] = self.reader.metadata
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_tensor_extents()

    def _check_tensor_extents(self) -> None:
        # A truncated file can still parse its header; make sure every tensor's bytes exist.
        size = os.path.getsize(self.path)
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ModelLoadError(
                    f"{self.path} is truncated: tensor {t.name!r} extends past the end of the file"
                )

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def model_config(self) -> ModelConfig:
        name = display_name(self.path)
        return ModelConfig.from_gguf_metadata(
            self.metadata, name=name, has_output_tensor="output.weight" in self.tensors
        )

    def qtype(self, name: str) -> Q:
        return Q(self.tensors[name].tensor_type)

    def check_supported(self) -> None:
        for t in self.reader.tensors:
            if t.name in _IGNORED:
                continue
            qt = Q(t.tensor_type)
            if qt not in SUPPORTED_QTYPES:
                raise ModelLoadError(
                    f"unsupported GGUF quantization type {qt.name} (tensor {t.name!r}); "
                    f"supported: {', '.join(sorted(q.name for q in SUPPORTED_QTYPES))}"
                )

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy, shaped [out, in] (row-major, as PyTorch stores it)."""
        t = self.tensors[name]
        qt = Q(t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))
        if qt == Q.F32:
            arr = np.asarray(t.data, dtype=np.float32)
        elif qt == Q.F16:
            arr = np.asarray(t.data, dtype=np.float16).astype(np.float32)
        else:
            arr = gguf.quants.dequantize(t.data, qt)
        return arr.reshape(shape)

    def raw_blocks(self, name: str) -> np.ndarray:
        """The packed bytes of a quantized tensor, [rows, bytes_per_row] uint8."""
        return np.asarray(self.tensors[name].data)

    def state_dict(self, cfg: ModelConfig) -> LazyWeights:
        """hf_name -> float32 tensor for every weight, each dequantized when asked (Q/K
        un-permuted for llama-arch files)."""
        self.check_supported()
        permute = cfg.architecture in ("llama", "mistral")
        makers, shapes = {}, {}
        for gname, t in self.tensors.items():
            if gname in _IGNORED:
                continue
            name = hf_name(gname, cfg.architecture)
            if name is None:
                raise ModelLoadError(f"unexpected tensor {gname!r} in GGUF file for architecture {cfg.architecture}")
            heads = None
            if permute and gname.endswith(("attn_q.weight", "attn_q.bias")):
                heads = cfg.num_heads
            elif permute and gname.endswith(("attn_k.weight", "attn_k.bias")):
                heads = cfg.num_kv_heads
            makers[name] = functools.partial(self._float_tensor, gname, heads)
            shapes[name] = tuple(int(x) for x in reversed(t.shape))
        return LazyWeights(makers, shapes)

    def _float_tensor(self, gname: str, heads: int | None) -> torch.Tensor:
        import torch  # (here: reading metadata needs no torch)

        w = self.dequantize(gname)
        if heads is not None:
            w = _reverse_permute(w, heads)
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))

    def int4_grid(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A Q4_K tensor's own codes and grid per group of 32, w = q * d + m: q [N, K]
        uint8 (0..15), d = the super-block's d x the group's 6-bit scale and m = -(dmin x
        its 6-bit min), [N, K/32] float32; gguf's dequantization computes exactly this.
        None for other types (Q4_0 and Q4_1 codes come back from their floats exactly)."""
        t = self.tensors[name]
        if Q(t.tensor_type) != Q.Q4_K:
            return None
        rows, cols = (int(x) for x in reversed(t.shape))
        blocks = np.asarray(t.data).reshape(-1, 144)
        nb = blocks.shape[0]
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        dd = d * sc.astype(np.float32)
        mm = -(dmin * mn.astype(np.float32))
        qs = blocks[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(rows, cols)
        return q, dd.reshape(rows, cols // 32), mm.reshape(rows, cols // 32)

    def q5_0_grid(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A Q5_0 tensor's own codes and scales, w = (q - 16) * d: q [N, K] uint8 (0..31: the
        low nibble from qs, the fifth bit from qh) and d [N, K/32] float32 (the block's
        float16); gguf's dequantization computes exactly this. None for other types."""
        t = self.tensors[name]
        if Q(t.tensor_type) != Q.Q5_0:
            return None
        rows, cols = (int(x) for x in reversed(t.shape))
        return q5_0_codes(np.asarray(t.data), rows, cols)

    def int4_grids(self, cfg: ModelConfig) -> LazyWeights:
        """hf_name -> (codes, d, m) for every Q4_K weight, rows in our order: int4 mode
        keeps these codes instead of rounding the dequantized floats a second time."""
        return self._grids(cfg, self.int4_grid)

    def q5_0_grids(self, cfg: ModelConfig) -> LazyWeights:
        """hf_name -> (codes, d) for every Q5_0 weight, rows in our order: int4 mode keeps
        them in Q5_0 tiles."""
        return self._grids(cfg, self.q5_0_grid)

    def _grids(self, cfg: ModelConfig, grid_of) -> LazyWeights:
        """hf_name -> grid for each weight of grid_of's type, made when asked."""
        kind = {self.int4_grid: Q.Q4_K, self.q5_0_grid: Q.Q5_0}[grid_of]
        permute = cfg.architecture in ("llama", "mistral")
        makers, shapes = {}, {}
        for gname, t in self.tensors.items():
            name = hf_name(gname, cfg.architecture)
            if name is None or Q(t.tensor_type) != kind:
                continue
            heads = None
            if permute and gname.endswith("attn_q.weight"):
                heads = cfg.num_heads
            elif permute and gname.endswith("attn_k.weight"):
                heads = cfg.num_kv_heads
            makers[name] = functools.partial(self._grid_tensors, grid_of, gname, heads)
            shapes[name] = tuple(int(x) for x in reversed(t.shape))
        return LazyWeights(makers, shapes)

    @staticmethod
    def _grid_tensors(grid_of, gname: str, heads: int | None) -> tuple:
        import torch

        grid = grid_of(gname)
        if heads is not None:
            grid = tuple(_reverse_permute(a, heads) for a in grid)
        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in grid)

    def wide_weights(self) -> set[str]:
        """hf_names of the weights stored in blocks of more than 5 bits (Q5_1, Q5_K, Q6_K,
        Q8_0): int4 mode keeps them at 8 bits rather than rounding them to 4."""
        return {hf_name(g, self.architecture) for g, t in self.tensors.items()
                if Q(t.tensor_type) in WIDE_QTYPES and hf_name(g, self.architecture) is not None}

    def rope_freqs(self) -> torch.Tensor | None:
        """Llama 3.1-style per-frequency rope divisors, when the file stores them."""
        import torch

        if "rope_freqs.weight" not in self.tensors:
            return None
        return torch.from_numpy(self.dequantize("rope_freqs.weight").copy())


def q5_0_codes(data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0 blocks (22 bytes per 32 weights: float16 d, 32 bits qh, 16 bytes qs) of a
    [rows, cols] tensor -> codes q [rows, cols] uint8 (0..31) and d [rows, cols/32] float32,
    w = (q - 16) * d."""
    blocks = data.reshape(-1, 22)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    qh = blocks[:, 2:6].copy().view("<u4")  # bit j: weight j's fifth bit
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [blocks, 32]
    qs = blocks[:, 6:22]  # weight j < 16 in qs[j]'s low nibble, weight 16 + j in its high one
    low = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)
    return (low | (high << np.uint8(4))).reshape(rows, cols), d.reshape(rows, cols // 32)


def display_name(path: str) -> str:
    """The served model id: the file's stem without its quantization suffix."""
    stem = os.path.basename(path)
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    return re.sub(r"[.-](?:[QqFfIi][QqFf]?\d[\w]*|BF16|bf16)$", "", stem) or stem
