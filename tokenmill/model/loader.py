"""Load a model and its tokenizer from a GGUF file or a Hugging Face folder.

Loading is separate from the model and loud: every expected key must be present
with the expected shape, and nothing unexpected may be left over.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tokenmill.model.config import ModelConfig, ModelLoadError
from tokenmill.model.lazy_weights import shape_of
from tokenmill.model.llama import DenseLinear, LlamaLayer, LlamaModel
from tokenmill.model.memory import drop_mapped_pages, pack_together, release_freed_memory
# (re-exported: the metadata side needs no torch, so a server's front process never loads it)
from tokenmill.model.metadata import EMBEDDED_FILE, EMBEDDED_PACKAGE, default_model_path, load_metadata  # noqa: F401
from tokenmill import logs
from tokenmill.model import prepared
from tokenmill.model.quant import (GROUP, QUANTIZATIONS, Int8BlockLinear, Q5BlockLinear, _int4_grid,
                                  _tileable, output_projection, quant_vnni_available, quantize_linear)
from tokenmill.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StoredBlocks:
    """What a GGUF file stores per weight (hf names), for int4 mode to keep: Q4_K codes
    and grids (kept in int4 tiles), Q5_0 codes and scales (kept in Q5_0 tiles), and the
    names of weights in blocks of more than 5 bits (kept at 8 bits, in Q8_0-style blocks:
    a Q8_0 weight exactly, a Q6_K one within an eighth of its step)."""
    int4: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (LazyWeights: each made when asked)
    q5_0: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    wide: set[str]


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer | None
    config: ModelConfig
    path: str
    gguf_qtypes: dict[str, str] | None = None  # per-tensor quant type names for GGUF sources
    quantization: str = "none"  # what the weights run as (`auto` resolved)
    activation_levels: int = 2  # int8 levels of the quantized layers' inputs (set_activation_levels)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}") from None


# A layer's norms by their checkpoint names: Llama's post-attention norm is the MLP's
# input norm; Gemma names that one pre-feedforward and puts norms on both outputs.
_LAYER_NORMS = {
    False: {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"},
    True: {"input_norm": "input_layernorm.weight", "post_norm": "pre_feedforward_layernorm.weight",
           "attn_out_norm": "post_attention_layernorm.weight", "ffn_out_norm": "post_feedforward_layernorm.weight"},
}


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        for norm in _LAYER_NORMS[cfg.output_norms].values():
            shapes[p + norm] = (h,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
    return shapes


def build_model(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                rope_freqs: torch.Tensor | None = None, quantization: str = "none",
                stored: StoredBlocks | None = None) -> LlamaModel:
    """Check the weights strictly, fuse q/k/v and gate/up, and quantize linears if asked
    (quantized linears compute in bfloat16, so the rest of the model does too). `weights`: a
    dict, or LazyWeights made one at a time as the layers are built. `stored`:
    the file's own blocks (GGUF), which int4 mode keeps rather than rounding to int4."""
    grids = stored.int4 if stored is not None else None
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    if quantization != "none":
        dtype = torch.bfloat16
    expected = _expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints still store a copy
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[0]!r}")
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} unexpected weights, e.g. {unexpected[0]!r}")
    for name, shape in expected.items():
        if shape_of(weights, name) != shape:
            raise ModelLoadError(f"weight {name!r} has shape {shape_of(weights, name)}, expected {shape}")

    def w(name: str) -> torch.Tensor:
        return weights[name].to(dtype).contiguous()

    def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, precise: bool = False,
               names: tuple[str, ...] = ()):
        if quantization == "none":
            return DenseLinear(weight.to(dtype).contiguous(), bias)
        kept = kept_blocks(weight, bias, names)
        return kept if kept is not None else quantize_linear(quantization, weight, bias, precise, grid_of(names))

    def kept_blocks(weight: torch.Tensor, bias: torch.Tensor | None, names: tuple[str, ...]):
        """int4 mode chosen by `auto`, on the native kernels: a layer whose parts the file
        stores all as Q5_0 in Q5_0 tiles (the file's codes); one with parts in wider blocks
        (and the rest Q5_0) in 8-bit blocks. None: int4 as usual."""
        if quantization != "int4" or stored is None or not quant_vnni_available() or not _tileable(*weight.shape):
            return None
        if all(n in stored.q5_0 for n in names):
            grids_ = [stored.q5_0[n] for n in names]
            codes = torch.cat([g[0] for g in grids_])
            d = torch.cat([g[1] for g in grids_])
            return Q5BlockLinear(codes, d, bias)
        if any(n in stored.wide for n in names) and all(n in stored.wide or n in stored.q5_0 for n in names):
            return Int8BlockLinear(weight, bias, float_out=False)
        return None

    def grid_of(names: tuple[str, ...]):
        """The fused rows' int4 grid when any part has the file's own: the others' derived
        from their floats as Int4Linear would."""
        if quantization != "int4" or not grids or not any(n in grids for n in names):
            return None
        parts = []
        for n in names:
            if n in grids:
                q, d, m = grids[n]
            else:
                wf = weights[n].float()
                r, c = wf.shape
                if c % GROUP:
                    return None
                d, m, q = _int4_grid(wf.view(r, c // GROUP, GROUP))
            parts.append((q.reshape(q.shape[0], -1), d.float(), m.float()))
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))

    def f32(name: str) -> torch.Tensor:
        return weights[name].float()

    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        qkv_w = torch.cat([f32(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        qkv_b = torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"]) if cfg.attention_bias else None
        gate_up = torch.cat([f32(p + "mlp.gate_proj.weight"), f32(p + "mlp.up_proj.weight")])
        norms = {field: w(p + name) for field, name in _LAYER_NORMS[cfg.output_norms].items()}
        if cfg.qk_norm:
            norms.update(q_norm=w(p + "self_attn.q_norm.weight"), k_norm=w(p + "self_attn.k_norm.weight"))
        layers.append(LlamaLayer(
            **norms,
            window=cfg.layer_window(n),
            # Every layer's inputs take two int8 levels (~16 bits) on the VNNI kernels: the
            # norms' outputs and silu * up carry outlier channels, and with one level greedy
            # answers left the exact mode's on 38 of 64 prompts against 13 with two
            # (benchmarks/fidelity.py); two levels cost ~15% of decode speed at 16 rows and
            # little at one, where the weight stream sets the time. A model whose answers keep
            # their fidelity with one level gets one after loading (set_activation_levels).
            qkv=linear(qkv_w, qkv_b, precise=True, names=tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
            o_proj=linear(f32(p + "self_attn.o_proj.weight"), precise=True, names=(p + "self_attn.o_proj.weight",)),
            gate_up=linear(gate_up, precise=True, names=(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
            down=linear(f32(p + "mlp.down_proj.weight"), precise=True, names=(p + "mlp.down_proj.weight",)),
        ))
    embed = w("model.embed_tokens.weight")
    if quantization == "none" and cfg.tie_word_embeddings:
        lm_head = DenseLinear(embed)  # one tensor for both
    else:
        head = f32("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        # The output projection sets every logit: int4 there costs far more quality than
        # in the blocks (benchmarks/quality.py), so it stays at 8 bits, in Q8_0's blocks
        # (the embedded file's own, recovered exactly) where the VNNI kernels run.
        lm_head = linear(head) if quantization == "none" else output_projection(head)
    model = LlamaModel(cfg, embed, layers, w("model.norm.weight"), lm_head, dtype, rope_freqs)
    release_freed_memory()  # (the float temporaries' pages, before the packed copy grows)
    _pack_tiles(model)
    return model


def _pack_tiles(model: LlamaModel, mapped: bool = False) -> None:
    """The small-batch kernels' packed weights, streamed whole every decode step: into one
    huge-page buffer (tokenmill.model.memory), each source let go once copied. mapped: they
    were read from the prepared file's mapping, whose copied pages are then let go."""
    packed = [lin for lin in model.linears() if getattr(lin, "tiles", None) is not None]

    def placed(i: int, source: torch.Tensor, copy: torch.Tensor) -> None:
        packed[i].tiles = copy
        if mapped:
            drop_mapped_pages([source])

    pack_together([lin.tiles for lin in packed], placed)


ACTIVATION_LEVELS = (1, 2)


def set_activation_levels(model: LlamaModel, levels: int) -> int:
    """The int8 levels the quantized blocks' inputs take on the VNNI kernels: 2 (~16 bits,
    the default: the rounding residual in a second level) or 1 (llama.cpp's class: half
    the dot products, ~1.5x a 16-row step; a model decides, by its fidelity: see
    registry.ModelRecipe.activation_levels). The output projection keeps two either way.
    The tiles are the same, so the prepared-weights cache is shared. Returns `levels`."""
    if levels not in ACTIVATION_LEVELS:
        raise ModelLoadError(f"activation levels must be one of {ACTIVATION_LEVELS}, got {levels!r}")
    for layer in model.layers:
        for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            if hasattr(lin, "precise"):
                lin.precise = levels == 2
    return levels


def load_model(path: str | None = None, dtype: str | torch.dtype = "float32",
               quantization: str = "none", activation_levels: int | None = None) -> LoadedModel:
    """Load weights (dequantized to `dtype`, or re-quantized for the packed kernels) and
    the tokenizer from `path`, or the embedded model. A quantized model's prepared weights
    are cached on disk (tokenmill/model/prepared.py): later starts map them instead.
    activation_levels: set_activation_levels' (None: the recipe that installs the file
    says, else 2)."""
    loaded = _load(path, dtype, quantization)
    if loaded.quantization == "none":
        return loaded
    if activation_levels is None:
        from tokenmill.model.registry import recipe_activation_levels

        activation_levels = recipe_activation_levels(os.path.basename(loaded.path))
    loaded.activation_levels = set_activation_levels(loaded.model, activation_levels)
    if activation_levels != 2 and quant_vnni_available():
        logs.say(f"{os.path.basename(loaded.path)}: the quantized layers' inputs in {activation_levels} int8 "
                 "level (--activation-levels)")
    return loaded


def _load(path: str | None, dtype: str | torch.dtype, quantization: str) -> LoadedModel:
    path = path or default_model_path()
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    if not os.path.exists(path):
        raise ModelLoadError(f"model path not found: {path}")
    if os.path.isdir(path):
        from tokenmill.model.safetensors_loader import HFCheckpoint

        ckpt = HFCheckpoint(path)
        cfg = ckpt.model_config()
        tokenizer = Tokenizer.from_hf_folder(path, cfg)
        qtypes = None
        weights = rope_freqs = None
    else:
        from tokenmill.model.gguf_loader import GGUFFile

        gf = GGUFFile(path)
        cfg = gf.model_config()
        tokenizer = Tokenizer.from_gguf_metadata(gf.metadata)
        qtypes = {n: gf.qtype(n).name for n in gf.tensors}
    # `auto` keeps the file's 5- to 8-bit blocks (Q5_0 tiles, 8-bit blocks) where int4
    # mode would round them; an explicit `int4` means 4 bits everywhere, as it says.
    keep = False
    if quantization == "auto":
        quantization = file_quantization(qtypes)
        keep = _keeps_blocks(quantization, qtypes)
        logs.say(f"{os.path.basename(path)}: weights run as {quantization} "
                 f"(--quantization auto: {kept_description(quantization, qtypes, keep)})")
    # Only quantized models are worth caching: a dense one is its file's tensors converted.
    file = None
    if quantization != "none":
        file = prepared.cache_file(path, torch.bfloat16, quantization + ("+blocks" if keep else ""),
                                   quant_vnni_available())
    model = prepared.load(file) if file else None
    if model is not None:
        _pack_tiles(model, mapped=True)
        return LoadedModel(model, tokenizer, cfg, path, qtypes, quantization)
    if file:
        logs.say(f"preparing {os.path.basename(path)} ({quantization}: dequantizing, requantizing, packing "
                     f"for the kernels); cached for later starts in {os.path.dirname(file)}")
    t0 = time.perf_counter()
    if os.path.isdir(path):
        weights = ckpt.state_dict(cfg)
    else:
        weights = gf.state_dict(cfg)
        rope_freqs = gf.rope_freqs()
    stored = None
    if quantization == "int4" and not os.path.isdir(path):
        stored = StoredBlocks(gf.int4_grids(cfg), gf.q5_0_grids(cfg) if keep else {},
                              gf.wide_weights() if keep else set())
    model = build_model(cfg, weights, torch_dtype, rope_freqs, quantization, stored)
    release_freed_memory()  # (the unpacked tiles' pages: ~0.9 GB for a 1.5B model)
    if file:
        prepared.save(model, file)
        logs.say(f"prepared in {time.perf_counter() - t0:.1f} s")
    return LoadedModel(model, tokenizer, cfg, path, qtypes, quantization)


def _layer_types(qtypes: dict[str, str] | None) -> set[str]:
    return {t for n, t in (qtypes or {}).items() if n.startswith("blk.") and "norm" not in n}


def _wide_types() -> set[str]:
    from tokenmill.model.gguf_loader import WIDE_QTYPES

    return {t.name for t in WIDE_QTYPES}


def _keeps_blocks(quantization: str, qtypes: dict[str, str] | None) -> bool:
    """Whether `auto`, resolved to `quantization`, keeps any of the file's 5- to 8-bit
    blocks (int4 mode on the native kernels only)."""
    return (quantization == "int4" and bool(_layer_types(qtypes) & ({"Q5_0"} | _wide_types()))
            and quant_vnni_available())


def kept_description(quantization: str, qtypes: dict[str, str] | None, keep: bool) -> str:
    """What `auto` keeps of the file's blocks, as build_model will (for the start's log)."""
    if quantization == "int8":
        return "the file's Q8_0 blocks"
    layer_types = _layer_types(qtypes)
    parts = ["4-bit blocks as int4"]
    if keep:
        if "Q5_0" in layer_types:
            parts.append("Q5_0 as Q5_0")
        wide = sorted(layer_types & _wide_types())
        if wide:
            parts.append(f"layers with {'/'.join(wide)} parts at 8 bits")
    return ", ".join(parts)


def file_quantization(qtypes: dict[str, str] | None) -> str:
    """`auto`: the quantization that keeps what the file stores. The layers' weights in
    Q8_0 blocks run as int8 in Q8_0's own blocks; 4-bit (and other sub-8-bit) blocks as
    int4 (Q4_0 and Q4_1 codes exactly); float weights, and a Hugging Face folder, as int4,
    the fastest setting within 1% perplexity of float32 (benchmarks/quality.py)."""
    if not qtypes:
        return "int4"
    layer_types = [t for n, t in qtypes.items() if n.startswith("blk.") and n.endswith(".weight")
                   and "norm" not in n]
    q8 = sum(t == "Q8_0" for t in layer_types)
    return "int8" if layer_types and q8 * 2 > len(layer_types) else "int4"
