"""The fused decode step: a step of single-token decodes as one native call
(csrc/decode_step.cpp), and decode bursts of several such steps that pick each step's
token inside the call.

A FusedDecoder is built from a model and bound to one KV cache; the runner owns it.
It gives the same numbers as the model's separate native ops (the same kernels, the
same roundings), so each entry point answers None where it does not apply and the
caller runs the model's forward instead.

Why: a decode step of a small model is a few hundred small ops; one call keeps the
threads up for the whole step, and a burst also saves the engine's Python between steps.
"""

from __future__ import annotations

import torch

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.kernels import HEAD_DIMS
from tokenmill.model.quant import Int4Linear, Int8BlockLinear, Q5BlockLinear

FUSED_DECODE_ROWS = 17  # the fused decode step runs batches below this many rows
_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)  # the native step's "no bias" for a matmul
_NO_ADAPTERS = torch.empty(0, dtype=torch.int64)


class FusedDecoder:
    """A model's layers (and, where the output projection is in int8 block tiles, its
    embedding and head) as one native DecodeModel over `kv_cache`."""

    def __init__(self, model, native, kv_cache, has_head: bool):
        self.model = model
        self.native = native  # ops.DecodeModel
        self.kv_cache = kv_cache
        self.has_head = has_head  # whether the call also runs the embedding and the output projection

    @classmethod
    def build(cls, model, kv_cache, ops) -> FusedDecoder | None:
        """The fused decoder for `model` over `kv_cache`, or None where it cannot run:
        no native build with the step (AVX-512 VNNI and BF16, or AVX2), a dtype other
        than bfloat16, or a layer matmul off the int8-activation kernels. The families'
        parts (QK-norm, Gemma's output norms, GeGLU, scaled embeddings, sliding windows
        with their own RoPE) run inside the step as the model's native ops run them."""
        if ops is None or not hasattr(ops, "decode_step_available") or not ops.decode_step_available():
            return None
        cfg = model.cfg
        if cfg.head_dim not in HEAD_DIMS:
            return None
        lins = list(model.layer_linears())
        usable = (model.dtype == torch.bfloat16
                  and all(isinstance(lin, (Int4Linear, Int8BlockLinear, Q5BlockLinear)) and lin._vnni is not None
                          and (lin.bias is None or lin.bias.dtype == torch.bfloat16)
                          for lin in lins))
        if not usable:
            return None
        norms = [w for layer in model.layers for w in (layer.input_norm, layer.post_norm)] + [model.norm]
        native = ops.DecodeModel([lin.tiles for lin in lins], [lin.tile_kind for lin in lins], norms,
                                 model.cos32, model.sin32, cfg.num_heads, cfg.num_kv_heads,
                                 cfg.head_dim, cfg.rms_norm_eps, model.scale,
                                 [lin.bias.contiguous() if lin.bias is not None else _NO_BIAS for lin in lins])
        blocks = model.layers
        windows = [b.window for b in blocks]
        if cfg.qk_norm or cfg.output_norms or any(windows) or cfg.hidden_act != "silu":
            native.set_family([b.q_norm for b in blocks] if cfg.qk_norm else [],
                              [b.k_norm for b in blocks] if cfg.qk_norm else [],
                              [b.attn_out_norm for b in blocks] if cfg.output_norms else [],
                              [b.ffn_out_norm for b in blocks] if cfg.output_norms else [],
                              windows, model.local_rope.cos32, model.local_rope.sin32, cfg.hidden_act == "gelu_tanh")
        head = model.lm_head
        has_head = (isinstance(head, Int8BlockLinear) and model.embed.dtype == torch.bfloat16
                    and model.embed.is_contiguous())
        if has_head:
            # (the scale as the model's bf16 product has it)
            native.set_head(model.embed, head.tiles, float(model.embed_scale) if model.embed_scale is not None else 1.0)
        if model.adapters is not None and model.adapters.table is not None:
            native.set_lora(model.adapters.table)  # rows on adapters run inside the step too
        n = cfg.num_layers
        layers = [kv_cache.layer(i) for i in range(n)]
        scales = [kv_cache.layer_scales(i) for i in range(n)] if kv_cache.quantized else []
        native.bind_cache([k for k, _ in layers], [v for _, v in layers],
                          [k for k, _ in scales], [v for _, v in scales])
        return cls(model, native, kv_cache, has_head)

    @staticmethod
    def applies(meta: AttentionMetadata, rows: int) -> bool:
        """Whether a step of `rows` rows runs fused: single-token decodes only, under
        FUSED_DECODE_ROWS rows (below every layer's switch to its dense copy, so the
        separate ops would run the same packed kernels)."""
        return meta.num_decodes == rows and rows < FUSED_DECODE_ROWS

    def _rows(self, meta: AttentionMetadata) -> None:
        """The call's rows' adapter slots (the native object keeps them until changed)."""
        if self.model.adapters is not None:
            self.native.set_row_adapters(meta.lora_slots if meta.lora_slots is not None else _NO_ADAPTERS)

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor | None:
        """The final norm's output [T, hidden], as the model's forward gives it; None
        where the fused step does not apply."""
        if not self.applies(meta, input_ids.shape[0]):
            return None
        h = self.model.embed_tokens(input_ids)
        self._rows(meta)
        return self.native.forward(h, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                   meta.block_size)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step straight to (float32 logits [T, vocab], their row argmax [T]), the
        embedding and the output projection inside the call (the same numbers as forward,
        then the model's logits). None where that path does not apply."""
        if not (self.has_head and self.applies(meta, input_ids.shape[0])):
            return None
        self._rows(meta)
        logits, best = self.native.forward_logits(input_ids, positions, meta.slot_mapping, meta.block_tables,
                                                  meta.seq_lens, meta.block_size)
        return logits, best

    @torch.inference_mode()
    def decode_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     steps: int, temps: torch.Tensor, seeds: torch.Tensor, indices: torch.Tensor,
                     top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor | None:
        """A burst: `steps` decode steps in one call, each step's token the next step's
        input: the argmax where temps [T] is 0, else sampled at that temperature with the
        uniform of (seeds [T], indices [T] + step) after truncation by top_ks [T] int64,
        top_ps and min_ps [T] float32, as the engine's sampler draws (csrc/sampling.h):
        the tokens step-by-step decoding would pick. int64 [steps, T].
        The block tables must hold every step's slot. None where the fused path does not
        apply."""
        if not (self.has_head and self.applies(meta, input_ids.shape[0])):
            return None
        self._rows(meta)
        return self.native.decode_steps(input_ids, positions, meta.block_tables, meta.seq_lens,
                                        meta.block_size, steps, temps, seeds, indices, top_ks, top_ps, min_ps)
