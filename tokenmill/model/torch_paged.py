"""The decoder on any torch device (CUDA, or the CPU for tests): the torch runner's model
path (tokenmill/engine/torch_runner.py, issue 46).

Only PyTorch ops: no native CPU kernel, nothing compiled on the machine. The weights of a
LlamaModel (tokenmill/model/llama.py: the same families and switches) are moved to the
device in place, the KV cache lives there in the engine's layout ([layers, 2, kv_heads,
slots, head_dim], slot = block * block_size + offset, the blocks the KV manager hands
out), and attention is SDPA over each sequence's gathered pages:

- decode rows (one new token each) in one call: every row's block table gathered to
  [rows, kv_heads, blocks * block_size, head_dim], keys past its length masked; every
  shape is set by (rows, table width), so the step can be captured as a CUDA graph;
- each prefill chunk alone, over its cached context and its own keys (a prefix hit or
  an earlier chunk is context like any other).

A query group of G heads sharing one K/V head rides on the query axis ([.., G * n, d]),
so no backend needs GQA support. The cache holds one more block than the KV manager
hands out (`scratch_block`): the padding rows of a CUDA-graph bucket write there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.model.llama import DenseLinear, LlamaModel


class TorchKVCache:
    """K/V storage on `device`: [layers, 2, kv_heads, (num_blocks + 1) * block_size, head_dim],
    the last block scratch. The same interface as tokenmill/kv/cache.py's KVCache where the
    model reads it (`layer`, `layer_scales`); no int8 rows, no disk tier."""

    quantized = False

    def __init__(self, num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        self.data = torch.zeros((num_layers, 2, num_kv_heads, slots, head_dim), dtype=dtype, device=device)
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def layer_scales(self, i: int) -> tuple[None, None]:
        return None, None


def move_model(model: LlamaModel, device: torch.device) -> LlamaModel:
    """Move `model`'s tensors to `device` in place (a tensor shared by two holders, a tied
    output projection, moves once). Only dense weights: quantized layers are packed for
    the native CPU kernels and have no torch path here."""
    if not isinstance(model, LlamaModel):
        raise ValueError(f"the torch runner runs Llama-family decoders, not {type(model).__name__}")
    if model.adapters is not None:
        raise ValueError("the torch runner has no LoRA path yet")
    moved: dict[int, torch.Tensor] = {}

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in moved:
            moved[id(t)] = t.to(device)
        return moved[id(t)]

    for lin in model.linears():
        if not isinstance(lin, DenseLinear):
            raise ValueError(f"the torch runner needs dense weights (--quantization none), not {type(lin).__name__}")
    model.embed = to(model.embed)
    model.norm = to(model.norm)
    for lin in model.linears():
        lin.weight, lin.bias = to(lin.weight), to(lin.bias)
    for layer in model.layers:
        for name in ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "ffn_out_norm"):
            setattr(layer, name, to(getattr(layer, name)))
    for rope in {id(r): r for r in (model.rope, model.local_rope)}.values():
        rope.cos, rope.sin = to(rope.cos), to(rope.sin)
    if model.embed_scale is not None:
        model.embed_scale = to(model.embed_scale)
    return model


@dataclass
class PrefillChunk:
    start: int  # first row in the flat batch
    query_len: int
    context_len: int  # tokens cached before the chunk
    table: torch.Tensor  # [blocks covering context_len + query_len] block ids, on the device


@dataclass
class TorchBatch:
    """One step's flat batch on the device: decode rows first, then prefill chunks."""
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each token's K/V is written
    decode_tables: torch.Tensor | None = None  # [D, W] block ids (columns past a row's length: any block)
    decode_lens: torch.Tensor | None = None  # [D] tokens a decode row sees, its own included
    prefills: list[PrefillChunk] = field(default_factory=list)
    block_size: int = 16


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: TorchBatch,
                      scale: float, window: int) -> torch.Tensor:
    """q [D, H, d] over each row's gathered pages -> [D, H * d]; shapes fixed by (D, W)."""
    D, H, d = q.shape
    Hkv = k_cache.shape[0]
    bs = b.block_size
    S = b.decode_tables.shape[1] * bs
    kpos = torch.arange(S, device=q.device)
    slots = (b.decode_tables[:, :, None] * bs + kpos[:bs]).reshape(D, S)
    keys = k_cache[:, slots].transpose(0, 1)  # [D, Hkv, S, d]
    values = v_cache[:, slots].transpose(0, 1)
    lens = b.decode_lens[:, None]
    visible = kpos[None, :] < lens
    if window:
        visible = visible & (kpos[None, :] >= lens - window)
    out = F.scaled_dot_product_attention(q.view(D, Hkv, H // Hkv, d), keys, values,
                                         attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(D, H * d)


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: PrefillChunk,
                       block_size: int, scale: float, window: int) -> torch.Tensor:
    """q [n, H, d] of one chunk over its context and itself (written to the cache already)."""
    n, H, d = q.shape
    Hkv = k_cache.shape[0]
    g = H // Hkv
    L = p.context_len + n
    grid = torch.arange(L, device=q.device)
    slots = p.table[grid // block_size] * block_size + grid % block_size
    keys = k_cache[:, slots].unsqueeze(0)  # [1, Hkv, L, d]
    values = v_cache[:, slots].unsqueeze(0)
    qg = q.view(n, Hkv, g, d).permute(1, 2, 0, 3).reshape(1, Hkv, g * n, d)  # rows (member j, query i)
    qpos = (grid[p.context_len:]).repeat(g)[:, None]
    visible = grid[None, :] <= qpos
    if window:
        visible = visible & (grid[None, :] > qpos - window)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible, scale=scale)
    return out.view(Hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, H * d)


@torch.inference_mode()
def forward(model: LlamaModel, b: TorchBatch, kv: TorchKVCache) -> torch.Tensor:
    """The flat batch -> final hidden states [T, hidden], as LlamaModel.forward's torch path
    computes them, every tensor on the model's device."""
    cfg = model.cfg
    T = b.input_ids.shape[0]
    H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    D = 0 if b.decode_tables is None else b.decode_tables.shape[0]
    tables = {id(r): (r.cos[b.positions].unsqueeze(1), r.sin[b.positions].unsqueeze(1))
              for r in {id(r): r for r in (model.rope, model.local_rope)}.values()}
    h = model.embed_tokens(b.input_ids)
    for i, layer in enumerate(model.layers):
        x = model._rms_norm(h, layer.input_norm)
        qkv = layer.qkv(x)
        qk = qkv[:, : (H + Hkv) * d].view(T, H + Hkv, d)
        if layer.q_norm is not None:
            qk = torch.cat((model._rms_norm(qk[:, :H], layer.q_norm), model._rms_norm(qk[:, H:], layer.k_norm)), 1)
        qk = model._rope(qk, *tables[id(model.layer_rope(i))])
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * d:].view(T, Hkv, d)
        k_cache, v_cache = kv.layer(i)
        k_cache.index_copy_(1, b.slots, k.transpose(0, 1))
        v_cache.index_copy_(1, b.slots, v.transpose(0, 1))
        parts = []
        if D:
            parts.append(_decode_attention(q[:D], k_cache, v_cache, b, model.scale, layer.window))
        for p in b.prefills:
            parts.append(_prefill_attention(q[p.start:p.start + p.query_len], k_cache, v_cache, p,
                                            b.block_size, model.scale, layer.window))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        o = layer.o_proj(attn)
        h = h + (model._rms_norm(o, layer.attn_out_norm) if layer.attn_out_norm is not None else o)
        x = model._rms_norm(h, layer.post_norm)
        g, u = layer.gate_up(x).chunk(2, dim=-1)
        a = model.act(g) * u
        dn = layer.down(a)
        h = h + (model._rms_norm(dn, layer.ffn_out_norm) if layer.ffn_out_norm is not None else dn)
    return model._rms_norm(h, model.norm)
