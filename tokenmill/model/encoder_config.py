"""An encoder model's description, without its weights (no torch): a BERT-family
checkpoint in a sentence-transformers folder (config.json, model.safetensors,
tokenizer.json, modules.json with its Pooling and Normalize modules,
sentence_bert_config.json). Everything is read from those files, never guessed from a
name; what tokenmill cannot run the same way sentence-transformers does is refused here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tokenmill.model.config import ModelLoadError

ENCODER_TYPES = ("bert",)  # config.json model_type values the encoder runs
# sentence-transformers' Pooling modes -> ours (tokenmill/engine/types.py POOLINGS plus "cls")
_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                  "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pooling: str  # how the token states become one vector: mean, cls or last
    normalize: bool  # the vectors are L2-normalized (a Normalize module)
    max_seq_length: int  # the longest input, special tokens included (the model was trained to it)
    # sizes an embedding may be truncated to (then renormalized), for a model trained for it
    # (Matryoshka): None: none; (): any size up to hidden_size
    truncatable: tuple[int, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()  # (an encoder generates nothing)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def is_encoder_folder(path: str | None) -> bool:
    """A folder whose config.json names an encoder architecture."""
    if path is None or not os.path.isdir(path):
        return False
    cfg = _json(os.path.join(path, "config.json"), required=False)
    return cfg is not None and cfg.get("model_type") in ENCODER_TYPES


def _json(path: str, required: bool = True) -> Any:
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"the encoder folder lacks {os.path.basename(path)}: {path}")
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_encoder_config(folder: str) -> EncoderConfig:
    cfg = _json(os.path.join(folder, "config.json"))
    if cfg.get("model_type") not in ENCODER_TYPES:
        raise ModelLoadError(f"not an encoder checkpoint (model_type {cfg.get('model_type')!r}); "
                             f"supported: {', '.join(ENCODER_TYPES)}")
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"unsupported encoder activation {cfg.get('hidden_act')!r}; supported: gelu")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError("only absolute position embeddings are supported")
    modules = _json(os.path.join(folder, "modules.json"), required=False) or []
    types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    pooling = "cls"  # a bare BERT checkpoint: its [CLS] state, as transformers' feature extraction
    for m in modules:
        if m.get("type", "").endswith(".Pooling"):
            pc = _json(os.path.join(folder, m.get("path", ""), "config.json"))
            modes = [ours for key, ours in _POOLING_MODES.items() if pc.get(key)]
            others = [k for k, v in pc.items() if k.startswith("pooling_mode") and v and k not in _POOLING_MODES]
            if len(modes) != 1 or others or pc.get("include_prompt", True) is not True:
                raise ModelLoadError(f"unsupported pooling configuration in {m.get('path')}: {pc}")
            pooling = modes[0]
    unknown = [t for t in types if t not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise ModelLoadError(f"unsupported sentence-transformers modules: {', '.join(unknown)}")
    st = _json(os.path.join(folder, "sentence_bert_config.json"), required=False) or {}
    max_pos = int(cfg["max_position_embeddings"])
    max_seq = min(int(st.get("max_seq_length", max_pos)), max_pos)
    hidden = int(cfg["hidden_size"])
    # vLLM's spelling of a Matryoshka-trained model in config.json
    dims = cfg.get("matryoshka_dimensions")
    truncatable = tuple(int(d) for d in dims) if dims else (() if cfg.get("is_matryoshka") else None)
    if truncatable and not all(1 <= d <= hidden for d in truncatable):
        raise ModelLoadError(f"matryoshka_dimensions must be in [1, {hidden}]")
    return EncoderConfig(
        architecture=cfg["model_type"], name=os.path.basename(os.path.normpath(folder)),
        vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
        max_position_embeddings=max_pos, type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), pooling=pooling,
        normalize="Normalize" in types, max_seq_length=max_seq, truncatable=truncatable)


def read_encoder_tokenizer(folder: str):
    """tokenizer.json without the truncation and padding it may carry: an input longer
    than the model takes is the client's 400, not silently cut."""
    from tokenizers import Tokenizer as HFTokenizer

    from tokenmill.model.tokenizer import Tokenizer

    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"the encoder folder lacks tokenizer.json: {folder}")
    hf = HFTokenizer.from_file(path)
    hf.no_truncation()
    hf.no_padding()
    return Tokenizer(hf, None, (), None)
