"""Small factories shared by tests: run a model on one sequence, build engines."""

from __future__ import annotations

import torch

from tokenmill.kv.cache import KVCache
from tokenmill.model.attention import AttentionMetadata, PrefillSeq


def full_logits(model, ids: list[int], chunk: int | None = None, kv_dtype: torch.dtype | None = None,
                kernel=None, lora_slot: int = -1) -> torch.Tensor:
    """Logits at every position of `ids` through the paged path, prefilled in chunks of
    `chunk` tokens (None: one chunk); a chunk of 1 exercises the decode path. kernel: the
    native ops for the metadata (None: the torch path); lora_slot: the LoRA adapter slot
    every row runs under (-1: none)."""
    cfg = model.cfg
    bs = 16
    nblocks = -(-len(ids) // bs)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, nblocks, bs, cfg.head_dim, model.dtype, kv_dtype)
    # blocks in reverse order, so the block table is not the identity
    table = torch.arange(nblocks - 1, -1, -1)
    slots_all = table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nblocks)
    out = []
    step = chunk or len(ids)
    for s in range(0, len(ids), step):
        n = min(step, len(ids) - s)
        pos = torch.arange(s, s + n)
        if n == 1 and s > 0:
            L = s + 1
            meta = AttentionMetadata(slot_mapping=slots_all[pos], num_decodes=1,
                                     decode_slots=slots_all[:L].view(1, L),
                                     decode_mask=torch.ones(1, 1, 1, L, dtype=torch.bool))
        else:
            meta = AttentionMetadata(slot_mapping=slots_all[pos], num_decodes=0,
                                     prefills=[PrefillSeq(0, n, s, slots_all[:s + n] if s else None)])
        if lora_slot >= 0:
            meta.lora_slots = torch.full((n,), lora_slot, dtype=torch.int64)
        if kernel is not None:
            meta.kernel = kernel
            meta.block_tables = table.view(1, -1)
            meta.seq_lens = torch.tensor([s + n])
        h = model.forward(torch.tensor(ids[s:s + n]), pos, meta, cache)
        out.append(model.logits(h))
    return torch.cat(out)


def tiny_loaded(vocab: int = 300, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                max_pos: int = 512, seed: int = 0):
    """A random Llama small enough that an engine step costs about a millisecond."""
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.loader import LoadedModel, _expected_shapes, build_model

    cfg = ModelConfig(architecture="llama", name="tiny", vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=2 * hidden, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=max_pos, tie_word_embeddings=True,
                      eos_token_ids=(0,))
    g = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(shape, generator=g) * (1.0 if len(shape) == 1 else 0.5)
               for name, shape in _expected_shapes(cfg).items()}
    return LoadedModel(build_model(cfg, weights, torch.float32), None, cfg, "tiny")


def make_engine(loaded, *, num_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 64,
                max_num_batched_tokens: int = 512, prefix_caching: bool = True, max_model_len=None,
                native_attention: bool = True, decode_steps: int = 8, kv_cache_dtype: str = "auto",
                batch_share: float = 0.05, batch_step_tokens: int = 16):
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.config import SchedulerConfig

    cfg = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  decode_steps=decode_steps, batch_share=batch_share,
                                  batch_step_tokens=batch_step_tokens),
        max_model_len=max_model_len, native_attention=native_attention)
    return LLMEngine(loaded, cfg)


def run_to_completion(engine, requests: dict[str, tuple[list[int], object]], check=None):
    """Add all requests, step until idle; returns {request_id: {index: token ids}} and texts."""
    tokens: dict[str, dict[int, list[int]]] = {}
    texts: dict[str, dict[int, str]] = {}
    finish: dict[str, dict[int, str]] = {}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, {}).setdefault(out.index, []).extend(out.new_token_ids)
            texts.setdefault(out.request_id, {}).setdefault(out.index, "")
            texts[out.request_id][out.index] += out.text
            if out.finished:
                finish.setdefault(out.request_id, {})[out.index] = out.finish_reason
        if check is not None:
            check(engine)
    return tokens, texts, finish
