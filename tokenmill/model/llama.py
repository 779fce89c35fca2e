"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a flat batch.

Plain objects rather than nn.Modules: the step path calls a few hundred small
functions per forward, and module dispatch overhead is measurable on two cores.
Q/K/V and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.model.attention import AttentionMetadata, paged_attention, row_view
from tokenmill.model.config import ModelConfig


class DenseLinear:
    """y = x W^T + b with the weight kept in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)


Linear = Callable[[torch.Tensor], torch.Tensor]


class LlamaLayer:
    def __init__(self, input_norm: torch.Tensor, qkv: Linear, o_proj: Linear,
                 post_norm: torch.Tensor, gate_up: Linear, down: Linear):
        self.input_norm = input_norm
        self.qkv = qkv
        self.o_proj = o_proj
        self.post_norm = post_norm
        self.gate_up = gate_up
        self.down = down


def rope_inv_freq(cfg: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if rope_freqs is not None:
        inv = inv / rope_freqs.float()
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class LlamaModel:
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[LlamaLayer],
                 norm: torch.Tensor, lm_head: Linear, dtype: torch.dtype,
                 rope_freqs: torch.Tensor | None = None):
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.scale = cfg.head_dim ** -0.5
        inv = rope_inv_freq(cfg, rope_freqs)
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inv)
        self.cos32 = freqs.cos()  # [max_pos, d/2], for the native rope
        self.sin32 = freqs.sin()
        self.cos = self.cos32.to(dtype)
        self.sin = self.sin32.to(dtype)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # One fused op (it accumulates bf16 input in fp32); the reference's five-op form
        # differs only by when it rounds back to bf16.
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden].

        `kv_cache.layer(i)` gives layer i's (k, v) cache tensors [kv_heads, slots, head_dim].
        With the native ops (meta.kernel) the residual add is fused into the next norm
        and rotary embedding is applied in place.
        """
        if meta.kernel is not None:
            return self._forward_native(input_ids, positions, meta, kv_cache, meta.kernel)
        cfg = self.cfg
        T = input_ids.shape[0]
        H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, d/2]
        sin = self.sin[positions].unsqueeze(1)
        h = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            qkv = layer.qkv(x)
            qk = self._rope(qkv[:, : (H + Hkv) * d].view(T, H + Hkv, d), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hkv) * d:].view(T, Hkv, d)
            k_cache, v_cache = kv_cache.layer(i)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, *kv_cache.layer_scales(i))
            h = h + layer.o_proj(attn)
            x = self._rms_norm(h, layer.post_norm)
            gu = layer.gate_up(x)
            g, u = gu.chunk(2, dim=-1)
            h = h + layer.down(F.silu(g) * u)
        return self._rms_norm(h, self.norm)

    def _forward_native(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        kv_cache, ops) -> torch.Tensor:
        cfg = self.cfg
        T = input_ids.shape[0]
        H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        # Attention takes each query row as its own sequence over the cache (row_view), so
        # that a row gets the same numbers whatever else the step holds: with AVX-512 every
        # row through decode attention (which writes the step's K/V first), as the fused
        # step does (tokenmill/model/fused.py); else paged_attention's per-row kernel.
        rows_native = ops.decode_attention_available()
        cos = self.cos32.index_select(0, positions)
        sin = self.sin32.index_select(0, positions)
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        n = len(self.layers)
        if rows_native:
            tables, lens = row_view(meta)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            ops.rope_(qkv, cos, sin, H + Hkv, d)
            k_cache, v_cache = kv_cache.layer(i)
            k_scale, v_scale = kv_cache.layer_scales(i)
            if rows_native:
                attn = ops.decode_attention(qkv, k_cache, v_cache, meta.slot_mapping, tables, lens,
                                            H, Hkv, meta.block_size, self.scale, k_scale, v_scale)
            else:
                q = qkv[:, :H * d].view(T, H, d)
                k = qkv[:, H * d:(H + Hkv) * d].view(T, Hkv, d)
                v = qkv[:, (H + Hkv) * d:].view(T, Hkv, d)
                attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, k_scale, v_scale)
            x = ops.add_rms_norm(h, layer.o_proj(attn), layer.post_norm, eps)
            next_norm = self.layers[i + 1].input_norm if i + 1 < n else self.norm
            x = ops.add_rms_norm(h, layer.down(ops.silu_mul(layer.gate_up(x))), next_norm, eps)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by one decode step (embedding rows excluded)."""
        total = self.norm.nbytes + sum(getattr(lin, "nbytes", 0) for lin in self.linears())
        for layer in self.layers:
            total += layer.input_norm.nbytes + layer.post_norm.nbytes
        return total

    def linears(self):
        """Every matmul's weight holder: the output projection, then each layer's."""
        yield self.lm_head
        yield from self.layer_linears()

    def layer_linears(self):
        """Each layer's matmuls in order: qkv, o_proj, gate_up, down."""
        for layer in self.layers:
            yield from (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
