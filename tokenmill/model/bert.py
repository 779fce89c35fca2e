"""A BERT-family encoder (bidirectional attention, no KV cache): token ids in, one
pooled vector per input out, as sentence-transformers computes it (Transformer ->
Pooling -> Normalize).

The batch is flat and unpadded, as the decoder's: `input_ids[T]` of several inputs
back to back, `cu[S + 1]` their offsets. Every linear layer runs over all T rows at
once; attention runs per length (the inputs of one length as one batch), each input
seeing all of its own tokens and none of another's, so no padding is computed and an
input's vector does not depend on what it is batched with beyond matmul rounding.

The linears run on oneDNN's float32 matmul with the weights packed once at load, where
torch has it: torch's default (F.linear) goes to MKL, whose kernels on AMD CPUs are its
AVX2 ones, and oneDNN's AVX-512 kernels ran these shapes 2.2-4x faster on this machine's
Zen 5 cores (benchmarks/serving/embeddings.py). Both are float32 with float32
accumulation (relative error ~1e-6 against float64 either way), and a row's result does
not depend on how many rows share the call.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tokenmill.model.config import ModelLoadError
from tokenmill.model.encoder_config import EncoderConfig, read_encoder_config

# checkpoint names that carry nothing the forward uses (a buffer, the NSP pooler head)
_UNUSED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def _expected_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"embeddings.word_embeddings.weight": (cfg.vocab_size, h),
              "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
              "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
              "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
    for n in range(cfg.num_layers):
        p = f"encoder.layer.{n}."
        for lin, (out, inp) in {"attention.self.query": (h, h), "attention.self.key": (h, h),
                                "attention.self.value": (h, h), "attention.output.dense": (h, h),
                                "intermediate.dense": (i, h), "output.dense": (h, i)}.items():
            shapes[p + lin + ".weight"] = (out, inp)
            shapes[p + lin + ".bias"] = (out,)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[p + ln + ".weight"] = (h,)
            shapes[p + ln + ".bias"] = (h,)
    return shapes


class _Linear:
    """y = x w^T + b, optionally followed by GELU (erf), on oneDNN's packed weights where
    available (see the module's doc), else F.linear."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor, gelu: bool = False):
        self.b, self.gelu = b, gelu
        self.packed = _onednn_pack(w, b, gelu)
        self.w = w if self.packed is None else None  # (the packed copy is the only one kept)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, *_ATTR[self.gelu])
        y = F.linear(x, self.w, self.b)
        return F.gelu(y) if self.gelu else y


_ATTR = {False: ("none", [], ""), True: ("gelu", [], "none")}  # (oneDNN's erf GELU: "none" approximation)


def _onednn_pack(w: torch.Tensor, b: torch.Tensor, gelu: bool) -> torch.Tensor | None:
    """w packed for oneDNN, or None where torch lacks it (a build without oneDNN) or its
    result on a probe differs from F.linear's beyond float32 rounding."""
    if w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, b, *_ATTR[gelu])
    except (RuntimeError, AttributeError):
        return None
    want = F.linear(probe, w, b)
    want = F.gelu(want) if gelu else want
    return packed if torch.allclose(got, want, rtol=1e-4, atol=1e-5) else None


class BertEncoder:
    """Weights as plain tensors (float32) and a forward over a flat batch."""

    def __init__(self, cfg: EncoderConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        w = weights
        self.word = w["embeddings.word_embeddings.weight"]
        self.pos = w["embeddings.position_embeddings.weight"]
        self.type0 = w["embeddings.token_type_embeddings.weight"][0]  # one segment: type id 0
        self.emb_ln = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.layers = []
        for n in range(cfg.num_layers):
            p = f"encoder.layer.{n}."
            # q, k and v as one matmul
            qkv_w = torch.cat([w[p + f"attention.self.{x}.weight"] for x in ("query", "key", "value")])
            qkv_b = torch.cat([w[p + f"attention.self.{x}.bias"] for x in ("query", "key", "value")])
            self.layers.append(dict(
                qkv=_Linear(qkv_w, qkv_b),
                out=_Linear(w[p + "attention.output.dense.weight"], w[p + "attention.output.dense.bias"]),
                ln1=(w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"]),
                up=_Linear(w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"], gelu=True),
                down=_Linear(w[p + "output.dense.weight"], w[p + "output.dense.bias"]),
                ln2=(w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])))

    def _ln(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], self.cfg.layer_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cu: list[int]) -> torch.Tensor:
        """The last layer's token states [T, hidden] of the inputs input_ids[cu[s]:cu[s+1]]."""
        positions = torch.cat([torch.arange(cu[s + 1] - cu[s]) for s in range(len(cu) - 1)])
        x = self._ln(self.word[input_ids] + self.pos[positions] + self.type0, self.emb_ln)
        # inputs of one length attend as one batch (one call a layer, not one per input)
        by_length: dict[int, list[int]] = {}
        for s in range(len(cu) - 1):
            by_length.setdefault(cu[s + 1] - cu[s], []).append(cu[s])
        # (None: the group is every row in order, as one input or equal lengths are: no gather)
        groups = [(n, None if n * len(starts) == len(input_ids) else
                   torch.cat([torch.arange(a, a + n) for a in starts])) for n, starts in by_length.items()]
        for layer in self.layers:
            qkv = layer["qkv"](x)  # [T, 3 * hidden]
            if groups[0][1] is None:
                attn = self._attend(qkv, groups[0][0])
            else:
                attn = torch.empty_like(x)
                for n, rows in groups:
                    attn.index_copy_(0, rows, self._attend(qkv.index_select(0, rows), n))
            x = self._ln(x + layer["out"](attn), layer["ln1"])
            x = self._ln(x + layer["down"](layer["up"](x)), layer["ln2"])
        return x

    def _attend(self, qkv: torch.Tensor, n: int) -> torch.Tensor:
        """Attention within each run of n rows of qkv [b * n, 3 * hidden] (inputs of length n
        back to back): [b * n, hidden]."""
        H, D = self.cfg.num_heads, self.cfg.head_dim
        b = qkv.shape[0] // n
        q, k, v = qkv.view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)  # 3 x [b, H, n, D]
        return F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).reshape(b * n, H * D)

    def pool(self, states: torch.Tensor, cu: list[int]) -> torch.Tensor:
        """One vector per input [S, hidden], pooled and (if the model says so) normalized."""
        rows = []
        for s in range(len(cu) - 1):
            h = states[cu[s]:cu[s + 1]]
            rows.append(h.mean(0) if self.cfg.pooling == "mean" else h[0] if self.cfg.pooling == "cls" else h[-1])
        out = torch.stack(rows)
        return F.normalize(out, p=2.0, dim=-1) if self.cfg.normalize else out

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        cu = [0]
        for ids in inputs:
            cu.append(cu[-1] + len(ids))
        ids = torch.tensor([t for x in inputs for t in x], dtype=torch.int64)
        return self.pool(self.forward(ids, cu), cu)


def load_encoder(folder: str) -> BertEncoder:
    """The encoder in `folder`, its weights checked by name, shape and dtype."""
    from safetensors.torch import load_file

    cfg = read_encoder_config(folder)
    path = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(path):
        raise ModelLoadError(f"the encoder folder lacks model.safetensors: {folder}")
    raw = load_file(path)
    raw = {k.removeprefix("bert."): v for k, v in raw.items()}  # BertForX checkpoints prefix their names
    want = _expected_shapes(cfg)
    missing = sorted(set(want) - set(raw))
    extra = sorted(set(raw) - set(want) - set(_UNUSED))
    if missing or extra:
        raise ModelLoadError(f"encoder weights do not match config.json: missing {missing[:5]}, unexpected {extra[:5]}")
    weights = {}
    for name, shape in want.items():
        t = raw[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.is_floating_point():
            raise ModelLoadError(f"{name} is {t.dtype}, not a floating-point tensor")
        weights[name] = t.float()
    return BertEncoder(cfg, weights)
