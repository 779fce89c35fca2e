"""Paged attention on CPU over a flat, unpadded batch.

The flat batch holds decode tokens first (one per sequence), then prefill chunks.
Every sequence reads its keys and values through slot indices derived from its
block table, so prefill with cached context, chunked prefill and decode all use
the same cache. The runner builds the metadata once per step; all layers share it.

With the native kernels every query row is computed as its own sequence over what the
cache holds up to its position (this step's keys and values are written first), with a
reduction order that depends only on that context: a token gives the same numbers alone
or batched, in one prefill chunk or many, after a prefix-cache hit or not. (The torch
path, used without the native kernels, does not promise that.)

A sliding-window layer (`window` > 0) lets the query at position p see keys
p - window + 1 .. p only, in every path: decode, prefill chunks, context from the
prefix cache. The cache keeps every key: full layers of the same model read them all.

Cache layout per layer: k, v each [kv_heads, num_slots, head_dim], where
slot = block_id * block_size + offset. Keeping heads outermost makes the gather of
one sequence's context a contiguous [kv_heads, L, head_dim] block per head, ready
for a batched matmul with no per-query-head copy (GQA folds the query group into
the query-length axis instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


# Torch path: chunks with cached context up to this many queries use two small matmuls
# per kv head (_grouped_attention) the same way as longer ones.


@dataclass
class PrefillSeq:
    start: int  # offset of the chunk's first token in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    slots: torch.Tensor | None  # [context_len + query_len] slots; None when context_len == 0
    seq_index: int = 0  # row in AttentionMetadata.block_tables


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    # For the native kernel (which reads the cache through block tables, no gather):
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int64
    seq_lens: torch.Tensor | None = None  # [S] context length including this step's tokens
    kernel: object | None = None  # the compiled extension, or None for the torch path
    block_size: int = 16
    decode_slots: torch.Tensor | None = None  # [D, L] context slots, padded
    decode_mask: torch.Tensor | None = None  # [1, D, 1, L] True where a key is visible
    # additive biases derived from decode_mask by the first layer, reused: (window, dtype) -> bias
    decode_biases: dict = field(default_factory=dict)
    prefills: list[PrefillSeq] = field(default_factory=list)
    # every query row as its own sequence (row_view), built once per step
    row_tables: torch.Tensor | None = None  # [T, max_blocks]
    row_lens: torch.Tensor | None = None  # [T] context up to and including the row
    row_starts: torch.Tensor | None = None  # [T + 1] = arange
    # each row's LoRA adapter slot (-1: the base model); None when no row has one
    lora_slots: torch.Tensor | None = None  # [T] int64


def row_view(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables [T, max_blocks], context lengths [T]) with each query row of the flat
    batch as its own sequence: the row's block table and its position + 1. A decode-only
    step's own tables and lengths already are that."""
    if meta.row_lens is None:
        D = meta.num_decodes
        if not meta.prefills:
            meta.row_tables, meta.row_lens = meta.block_tables[:D], meta.seq_lens[:D]
        else:
            seqs, lens = [torch.arange(D)], [meta.seq_lens[:D]]
            for p in meta.prefills:
                assert p.start == sum(x.numel() for x in lens), "rows: decodes, then the prefills in order"
                seqs.append(torch.full((p.query_len,), p.seq_index, dtype=torch.int64))
                lens.append(torch.arange(p.context_len + 1, p.context_len + p.query_len + 1))
            meta.row_tables = meta.block_tables.index_select(0, torch.cat(seqs))
            meta.row_lens = torch.cat(lens)
        meta.row_starts = torch.arange(meta.row_lens.numel() + 1)
    return meta.row_tables, meta.row_lens


_INV127 = torch.tensor(1 / 127, dtype=torch.float32)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d] rows -> (int8 rows, float32 scales [...]): symmetric, one scale a row.
    The native kernels (csrc/decode_attention.h, store_row) round the same way, so a
    token's cache bytes do not depend on which path wrote it."""
    xf = x.float()
    d = xf.abs().amax(-1) * _INV127
    inv = torch.where(d > 0, torch.reciprocal(d), torch.zeros_like(d))
    q = (xf * inv.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, d


def dequantize_kv(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * d.unsqueeze(-1)).to(dtype)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Attention as two batched matmuls, for short queries (decode, small chunks), where
    the fused kernel's setup costs more than the math. q [B, m, d], k/v [B, L, d],
    bias [B or 1, m or 1, L] additive (0 / -inf)."""
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(dim=-1), v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    window: int = 0) -> torch.Tensor:
    """q [T, H, d], k/v [T, Hkv, d] (new tokens) -> [T, H*d]. Writes k/v into the cache
    (an int8 cache: quantized, their scales into k_scale/v_scale [Hkv, slots]). window:
    the keys a query sees, itself included (0: all before it)."""
    T, H, d = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    quantized = k_scale is not None
    if quantized:
        # Every path then attends over what the cache holds, this chunk's own keys
        # included: a prompt gives the same numbers in one chunk or many, cached or not.
        kq, ks = quantize_kv(k)
        vq, vs = quantize_kv(v)
        k_cache.index_copy_(1, meta.slot_mapping, kq.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, vq.transpose(0, 1))
        k_scale.index_copy_(1, meta.slot_mapping, ks.t())
        v_scale.index_copy_(1, meta.slot_mapping, vs.t())
        k, v = dequantize_kv(kq, ks, q.dtype), dequantize_kv(vq, vs, q.dtype)
    else:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    if meta.kernel is not None:
        # each row over the cache (its own keys included), as its own sequence
        tables, lens = row_view(meta)
        return meta.kernel.paged_attention(q.contiguous(), k_cache, v_cache, tables, lens, meta.row_starts,
                                           meta.block_size, scale, k_scale, v_scale, window).view(T, H * d)

    def gather(cache: torch.Tensor, scales: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
        rows = cache.index_select(1, idx)
        return rows if scales is None else dequantize_kv(rows, scales.index_select(1, idx), q.dtype)

    out = torch.empty(T, H * d, dtype=q.dtype)
    D = meta.num_decodes
    if D:
        L = meta.decode_slots.shape[1]
        idx = meta.decode_slots.reshape(-1)
        kd = gather(k_cache, k_scale, idx).view(Hkv * D, L, d)
        vd = gather(v_cache, v_scale, idx).view(Hkv * D, L, d)
        # The query group of each kv head rides on the query axis: [Hkv * D, g, d].
        qd = q[:D].view(D, Hkv, g, d).transpose(0, 1).reshape(Hkv * D, g, d)
        bias = meta.decode_biases.get((window, q.dtype))
        if bias is None:  # once per step, shared by the layers
            visible = meta.decode_mask
            if window:  # each decode's last `window` keys
                lens = visible.sum(-1, keepdim=True)
                visible = visible & (torch.arange(L) >= lens - window)
            bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
            bias = meta.decode_biases[(window, q.dtype)] = bias.expand(Hkv, D, 1, L).reshape(Hkv * D, 1, L)
        od = _grouped_attention(qd, kd, vd, bias, scale)
        out[:D] = od.view(Hkv, D, g, d).transpose(0, 1).reshape(D, H * d)
    for p in meta.prefills:
        s, n = p.start, p.query_len
        if p.context_len == 0:
            qp = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            kp = k[s:s + n].transpose(0, 1).unsqueeze(0)
            vp = v[s:s + n].transpose(0, 1).unsqueeze(0)
            if window:
                i = torch.arange(n)
                near = (i.unsqueeze(0) <= i.unsqueeze(1)) & (i.unsqueeze(0) > i.unsqueeze(1) - window)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=near, scale=scale, enable_gqa=g > 1)
            else:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=g > 1)
            out[s:s + n] = o[0].transpose(0, 1).reshape(n, H * d)
            continue
        L = p.context_len + n
        kp = gather(k_cache, k_scale, p.slots)  # [Hkv, L, d]
        vp = gather(v_cache, v_scale, p.slots)
        # rows are (query i, group member j) -> query i sits at context_len + i
        qp = q[s:s + n].view(n, Hkv, g, d).transpose(0, 1).reshape(Hkv, n * g, d)
        qpos = torch.arange(p.context_len, L).repeat_interleave(g).unsqueeze(1)
        kpos = torch.arange(L).unsqueeze(0)
        hidden = (kpos > qpos) | (kpos <= qpos - window) if window else kpos > qpos
        bias = torch.zeros(n * g, L, dtype=q.dtype).masked_fill_(hidden, float("-inf"))
        o = _grouped_attention(qp, kp, vp, bias.unsqueeze(0), scale)  # [Hkv, n * g, d]
        out[s:s + n] = o.view(Hkv, n, g, d).transpose(0, 1).reshape(n, H * d)
    return out
