"""The decoder of the Llama family (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 3)
over a flat batch: one block, with the per-family switches read from the config
(tokenmill/model/config.py): a qkv bias, QK-norm, norms on the attention's and the MLP's
outputs, the MLP's activation, scaled embeddings, the attention scale, and sliding-window
layers with a RoPE base of their own.

Plain objects rather than nn.Modules: the step path calls a few hundred small
functions per forward, and module dispatch overhead is measurable on two cores.
Q/K/V and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from tokenmill.model.attention import AttentionMetadata, paged_attention, row_view
from tokenmill.model.config import ModelConfig

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


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
    """One block's weights. post_norm is the MLP's input norm (Llama's post-attention
    norm, Gemma's pre-feedforward one); q_norm and k_norm (QK-norm, [head_dim]) and
    attn_out_norm and ffn_out_norm (Gemma's norms on the two outputs) are None where the
    family has none. window: the keys a query sees (sliding layers), 0 for all."""

    def __init__(self, input_norm: torch.Tensor, qkv: Linear, o_proj: Linear,
                 post_norm: torch.Tensor, gate_up: Linear, down: Linear,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 attn_out_norm: torch.Tensor | None = None, ffn_out_norm: torch.Tensor | None = None,
                 window: int = 0):
        self.input_norm = input_norm
        self.qkv = qkv
        self.o_proj = o_proj
        self.post_norm = post_norm
        self.gate_up = gate_up
        self.down = down
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.attn_out_norm = attn_out_norm
        self.ffn_out_norm = ffn_out_norm
        self.window = window

    def norms(self) -> list[torch.Tensor]:
        return [n for n in (self.input_norm, self.post_norm, self.q_norm, self.k_norm, self.attn_out_norm,
                            self.ffn_out_norm) if n is not None]


def rope_inv_freq(cfg: ModelConfig, rope_freqs: torch.Tensor | None = None, theta: float | None = None,
                  scaling: dict | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2] for base `theta` (default the config's)
    and `scaling` (default the config's; {} for none)."""
    d = cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = (cfg.rope_scaling or {}) if scaling is None else scaling
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


@dataclass
class Rope:
    """cos and sin of every position [max_pos, head_dim / 2]: float32 for the native ops,
    the model dtype for the torch path."""
    cos32: torch.Tensor
    sin32: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, inv: torch.Tensor, max_pos: int, dtype: torch.dtype) -> Rope:
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        cos32, sin32 = freqs.cos(), freqs.sin()
        return cls(cos32, sin32, cos32.to(dtype), sin32.to(dtype))


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
        self.adapters = None  # AdapterSlots (tokenmill/model/lora.py) once the engine enables LoRA
        self.scale = cfg.attn_scale
        self.act = ACTIVATIONS[cfg.hidden_act]
        # Gemma scales embeddings by sqrt(hidden) rounded to the model dtype, as transformers does
        self.embed_scale = (torch.tensor(cfg.embed_multiplier, dtype=dtype) if cfg.embed_multiplier != 1.0
                            else None)
        self.rope = Rope.of(rope_inv_freq(cfg, rope_freqs), cfg.max_position_embeddings, dtype)
        # sliding layers with a RoPE base of their own (Gemma 3) take this table
        self.local_rope = self.rope
        if cfg.rope_local_theta is not None and any(cfg.is_sliding(i) for i in range(cfg.num_layers)):
            self.local_rope = Rope.of(rope_inv_freq(cfg, None, cfg.rope_local_theta, {}),
                                      cfg.max_position_embeddings, dtype)

    @property
    def cos32(self) -> torch.Tensor:
        return self.rope.cos32

    @property
    def sin32(self) -> torch.Tensor:
        return self.rope.sin32

    def _ropes(self) -> tuple[Rope, ...]:
        return (self.rope,) if self.local_rope is self.rope else (self.rope, self.local_rope)

    def layer_rope(self, i: int) -> Rope:
        return self.local_rope if self.layers[i].window else self.rope

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        return h * self.embed_scale if self.embed_scale is not None else h

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # One fused op (it accumulates bf16 input in fp32); the reference's five-op form
        # differs only by when it rounds back to bf16.
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _lora(self, meta: AttentionMetadata, layer: int, m: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter update of layer's matmul m (0 qkv, 1 o, 2 gate_up, 3 down)."""
        if meta.lora_slots is None or self.adapters is None:
            return y
        return self.adapters.apply_(4 * layer + m, x, y, meta.lora_slots)

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
        tables = {id(r): (r.cos[positions].unsqueeze(1), r.sin[positions].unsqueeze(1))  # [T, 1, d/2]
                  for r in self._ropes()}
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            qkv = self._lora(meta, i, 0, x, layer.qkv(x))
            qk = qkv[:, : (H + Hkv) * d].view(T, H + Hkv, d)
            if layer.q_norm is not None:
                qk = torch.cat((self._rms_norm(qk[:, :H], layer.q_norm), self._rms_norm(qk[:, H:], layer.k_norm)), 1)
            qk = self._rope(qk, *tables[id(self.layer_rope(i))])
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hkv) * d:].view(T, Hkv, d)
            k_cache, v_cache = kv_cache.layer(i)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, *kv_cache.layer_scales(i),
                                   window=layer.window)
            attn = attn.reshape(T, H * d)
            o = self._lora(meta, i, 1, attn, layer.o_proj(attn))
            h = h + (self._rms_norm(o, layer.attn_out_norm) if layer.attn_out_norm is not None else o)
            x = self._rms_norm(h, layer.post_norm)
            g, u = self._lora(meta, i, 2, x, layer.gate_up(x)).chunk(2, dim=-1)
            a = self.act(g) * u
            dn = self._lora(meta, i, 3, a, layer.down(a))
            h = h + (self._rms_norm(dn, layer.ffn_out_norm) if layer.ffn_out_norm is not None else dn)
        return self._rms_norm(h, self.norm)

    def _forward_native(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        kv_cache, ops) -> torch.Tensor:
        cfg = self.cfg
        T = input_ids.shape[0]
        H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        h = self.embed_tokens(input_ids).contiguous()  # the residual stream, updated in place
        # Attention takes each query row as its own sequence over the cache (row_view), so
        # that a row gets the same numbers whatever else the step holds: with AVX-512 every
        # row through decode attention (which writes the step's K/V first), as the fused
        # step does (tokenmill/model/fused.py); else paged_attention's per-row kernel.
        rows_native = ops.decode_attention_available()
        tables = {id(r): (r.cos32.index_select(0, positions), r.sin32.index_select(0, positions))
                  for r in self._ropes()}
        act_mul = ops.silu_mul if cfg.hidden_act == "silu" else ops.gelu_tanh_mul
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        n = len(self.layers)
        if rows_native:
            row_tables, lens = row_view(meta)
        for i, layer in enumerate(self.layers):
            qkv = self._lora(meta, i, 0, x, layer.qkv(x))
            if layer.q_norm is not None:
                ops.qk_norm_(qkv, layer.q_norm, layer.k_norm, H, Hkv, d, eps)
            ops.rope_(qkv, *tables[id(self.layer_rope(i))], H + Hkv, d)
            k_cache, v_cache = kv_cache.layer(i)
            k_scale, v_scale = kv_cache.layer_scales(i)
            if rows_native:
                attn = ops.decode_attention(qkv, k_cache, v_cache, meta.slot_mapping, row_tables, lens,
                                            H, Hkv, meta.block_size, self.scale, k_scale, v_scale, layer.window)
            else:
                q = qkv[:, :H * d].view(T, H, d)
                k = qkv[:, H * d:(H + Hkv) * d].view(T, Hkv, d)
                v = qkv[:, (H + Hkv) * d:].view(T, Hkv, d)
                attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, k_scale, v_scale,
                                       window=layer.window)
            attn = attn.reshape(T, H * d)
            o = self._lora(meta, i, 1, attn, layer.o_proj(attn))
            if layer.attn_out_norm is not None:
                ops.rms_norm_(o, layer.attn_out_norm, eps)
            x = ops.add_rms_norm(h, o, layer.post_norm, eps)
            a = act_mul(self._lora(meta, i, 2, x, layer.gate_up(x)))
            dn = self._lora(meta, i, 3, a, layer.down(a))
            if layer.ffn_out_norm is not None:
                ops.rms_norm_(dn, layer.ffn_out_norm, eps)
            next_norm = self.layers[i + 1].input_norm if i + 1 < n else self.norm
            x = ops.add_rms_norm(h, dn, next_norm, eps)
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
            total += sum(n.nbytes for n in layer.norms())
        return total

    def linears(self):
        """Every matmul's weight holder: the output projection, then each layer's."""
        yield self.lm_head
        yield from self.layer_linears()

    def layer_linears(self):
        """Each layer's matmuls in order: qkv, o_proj, gate_up, down."""
        for layer in self.layers:
            yield from (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
