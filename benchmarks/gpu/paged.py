"""A paged-KV Llama/Qwen2 decoder in plain PyTorch ops, for the device check (check.py).

Not the engine: the device check's own decoder, so the check runs from a plain checkout
on any machine with PyTorch (no tokenmill import, no native build, no model file). It
is written the way a GPU path of the engine would be (issue 46): weights taken from a
transformers model (the same random weights the parity phase compares against), one
KV pool of fixed-size blocks addressed through block tables, flat unpadded batches of
tokens (`input_ids[T]`, `positions[T]`, `slots[T]`), attention by SDPA over each
sequence's gathered pages, and a decode step whose every input lives in device buffers,
so it can be captured once per batch-size bucket as a CUDA graph and replayed.

Shapes: H query heads, K key/value heads (H = K * G), D head size, S = blocks * block
size keys a sequence sees, B sequences, Lq the longest query of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Batch:
    """One step's flat batch and where its tokens sit in the padded [B, Lq] layout."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]: block * block_size + offset, where each token's K/V is written
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]: tokens in the cache after this step
    q_index: torch.Tensor  # [B, Lq]: index into the T tokens (T: a zero row for padding)
    q_pos: torch.Tensor  # [B, Lq]: each query's position (0 for padding: it sees key 0 only)
    flat_index: torch.Tensor  # [T]: b * Lq + i, back from the padded layout
    last: torch.Tensor  # [B]: index in T of each sequence's last token (the one that samples)


def make_batch(seqs: list[tuple[list[int], int]], block_tables: torch.Tensor, block_size: int,
               device: torch.device) -> Batch:
    """A batch of (new token ids, tokens already cached) per sequence: a prefill (nothing
    cached), a prefill chunk after a prefix, or a decode step (one new token)."""
    ids, pos, slots, flat, last, q_index, q_pos, seq_lens = [], [], [], [], [], [], [], []
    lq = max(len(t) for t, _ in seqs)
    for b, (toks, cached) in enumerate(seqs):
        n = len(toks)
        p = list(range(cached, cached + n))
        row = block_tables[b].tolist()
        q_index.append(list(range(len(ids), len(ids) + n)) + [-1] * (lq - n))
        q_pos.append(p + [0] * (lq - n))
        ids += toks
        pos += p
        slots += [row[i // block_size] * block_size + i % block_size for i in p]
        flat += [b * lq + i for i in range(n)]
        last.append(len(ids) - 1)
        seq_lens.append(cached + n)
    t = len(ids)
    q_index = [[t if i < 0 else i for i in r] for r in q_index]

    def tensor(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return Batch(tensor(ids), tensor(pos), tensor(slots), block_tables.to(device), tensor(seq_lens),
                 tensor(q_index), tensor(q_pos), tensor(flat), tensor(last))


class Blocks:
    """A free list of KV blocks 1.. (0 is the scratch block), handed out shuffled so no
    block table is the identity."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()

    def table(self, tokens: int, width: int | None = None) -> torch.Tensor:
        n = -(-tokens // self.block_size)
        row = [self.free.pop() for _ in range(n)]
        return torch.tensor(row + [0] * ((width or n) - n), dtype=torch.long)


class PagedDecoder:
    """Llama (SmolLM2) and Qwen2 decoder layers over a paged KV pool; block 0 of the pool
    is scratch (padding rows of a CUDA-graph bucket write there), never a sequence's."""

    def __init__(self, hf_model, num_blocks: int, block_size: int = 16) -> None:
        cfg = hf_model.config
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.h, self.k = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.h
        self.eps = cfg.rms_norm_eps
        rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
        # transformers' inverse frequencies, computed the same way (float32)
        self.inv_freq = 1.0 / (rope["rope_theta"] ** (
            torch.arange(0, self.d, 2, dtype=torch.int64, device=self.device).float() / self.d))
        m = hf_model.model
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            bias = None
            if a.q_proj.bias is not None:
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            self.layers.append({
                "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
                "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), "qkv_bias": bias,
                "o": a.o_proj.weight, "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                "down": mlp.down_proj.weight})
        self.block_size = block_size
        self.num_blocks = num_blocks
        # [layers, 2 (K, V), blocks * block_size, K, D]: a slot indexes a row of a layer's K or V
        self.kv = torch.zeros(len(self.layers), 2, num_blocks * block_size, self.k, self.d,
                              dtype=self.dtype, device=self.device)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: float32 statistics, the weight applied in the model dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] rotated by each token's position (transformers' rotate_half form)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Batch) -> torch.Tensor:
        """Writes the step's K/V into the pool, then each sequence's queries attend over its
        gathered pages (keys at positions <= the query's, below its length)."""
        kv = self.kv[li]
        kv[0].index_copy_(0, b.slots, k)
        kv[1].index_copy_(0, b.slots, v)
        nb, lq = b.q_index.shape
        g = self.h // self.k
        s = b.block_tables.shape[1] * self.block_size
        # gather whole blocks: [B, max_blocks * block_size] slots
        slots = (b.block_tables[:, :, None] * self.block_size
                 + torch.arange(self.block_size, device=q.device)).reshape(nb, s)
        keys = kv[0][slots].transpose(1, 2)  # [B, K, S, D]
        values = kv[1][slots].transpose(1, 2)
        qp = torch.cat([q, q.new_zeros(1, self.h, self.d)])[b.q_index]  # [B, Lq, H, D]
        # a group's G query heads share one K/V head: fold them into the query axis
        qp = qp.view(nb, lq, self.k, g, self.d).permute(0, 2, 3, 1, 4).reshape(nb, self.k, g * lq, self.d)
        kpos = torch.arange(s, device=q.device)
        mask = (kpos[None, None, :] <= b.q_pos[:, :, None]) & (kpos[None, None, :] < b.seq_lens[:, None, None])
        mask = mask[:, None, None].expand(nb, 1, g, lq, s).reshape(nb, 1, g * lq, s)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=self.d ** -0.5)
        out = out.view(nb, self.k, g, lq, self.d).permute(0, 3, 1, 2, 4).reshape(nb * lq, self.h * self.d)
        return out[b.flat_index]  # [T, H * D]

    def forward(self, b: Batch, all_logits: bool = False) -> torch.Tensor:
        """Logits of each sequence's last token [B, V] (every token's [T, V] with all_logits)."""
        x = self.embed[b.input_ids]
        hd, kd = self.h * self.d, self.k * self.d
        for li, w in enumerate(self.layers):
            h = self.rms_norm(x, w["ln1"])
            qkv = F.linear(h, w["qkv"], w["qkv_bias"])
            q = self.rope(qkv[:, :hd].view(-1, self.h, self.d), b.positions)
            k = self.rope(qkv[:, hd:hd + kd].view(-1, self.k, self.d), b.positions)
            v = qkv[:, hd + kd:].view(-1, self.k, self.d)
            x = x + F.linear(self.attention(li, q, k, v, b), w["o"])
            h = self.rms_norm(x, w["ln2"])
            gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        x = self.norm_out(x if all_logits else x[b.last])
        return F.linear(x, self.lm_head)

    def norm_out(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(x, self.norm)


class DecodeGraphs:
    """Greedy decode steps for up to `max_batch` sequences from static device buffers: a
    step reads the last tokens, positions and block tables, writes the next tokens and
    advances the positions itself, so N steps need no host work between them. With
    capture (CUDA), one graph per batch-size bucket is captured at start, largest first,
    sharing one memory pool, and a batch runs in the smallest bucket that holds it
    (padding rows point at the scratch block); without (CPU, or graphs off), the same
    step runs eagerly on the same buffers, so the bucket logic is exercised anyway."""

    BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __init__(self, model: PagedDecoder, max_batch: int, max_blocks: int, capture: bool) -> None:
        self.model, self.capture = model, capture
        self.buckets = [x for x in self.BUCKETS if x < max_batch] + [max_batch]
        dev = model.device
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0
        if capture:
            self._capture_all()

    def _step(self, n: int) -> None:
        m, pos, tables = self.model, self.positions[:n], self.block_tables[:n]
        bs = m.block_size
        blocks = tables.gather(1, (pos // bs)[:, None])[:, 0]
        ar = torch.arange(n, device=pos.device)
        b = Batch(self.tokens[:n], pos, blocks * bs + pos % bs, tables, pos + 1, ar[:, None], pos[:, None], ar, ar)
        self.tokens[:n].copy_(m.forward(b).argmax(-1))
        self.positions[:n].add_(1)

    def _capture_all(self) -> None:
        import time

        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = None
        for n in reversed(self.buckets):
            self._reset(n)
            self._step(n)  # warm-up: kernels chosen, workspaces allocated, before capture
            self._reset(n)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._step(n)
            pool = pool or g.pool()
            self.graphs[n] = g
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved() - before

    def _reset(self, n: int) -> None:
        self.tokens[:n].zero_()
        self.positions[:n].zero_()
        self.block_tables[:n].zero_()  # the scratch block

    def bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
            steps: int) -> torch.Tensor:
        """`steps` greedy tokens [steps, n] after `tokens` (at `positions`) of n sequences."""
        n = tokens.shape[0]
        size = self.bucket(n)
        self._reset(size)
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        out = torch.empty(steps, n, dtype=torch.long, device=tokens.device)
        graph = self.graphs.get(size)
        for i in range(steps):
            if graph is not None:
                graph.replay()
            else:
                self._step(size)
            out[i].copy_(self.tokens[:n])
        return out
