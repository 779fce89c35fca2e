"""What a model is, without its weights: where the embedded model lives, its architecture
and tokenizer. Imports no torch: the server's front process (the engine runs in a child)
needs only this, and torch's import was a second of every start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenmill.model.config import ModelConfig, ModelLoadError
from tokenmill.model.embedded import EMBEDDED_FILE, EMBEDDED_PACKAGE, default_model_path  # noqa: F401
from tokenmill.model.encoder_config import EncoderConfig, is_encoder_folder, read_encoder_config, read_encoder_tokenizer
from tokenmill.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """A model without its weights: what a front end in another process than the engine
    needs (architecture, tokenizer, the model's own generation defaults)."""
    config: ModelConfig | EncoderConfig
    tokenizer: Tokenizer | None
    generation: dict[str, float | int]  # tokenmill/model/generation.py


def load_model_info(path: str | None = None) -> ModelInfo:
    from tokenmill.model.generation import model_generation_defaults

    resolved = path or default_model_path()
    if not os.path.exists(resolved):
        raise ModelLoadError(f"model path not found: {resolved}")
    if is_encoder_folder(resolved):  # an embedding model: no generation defaults
        return ModelInfo(read_encoder_config(resolved), read_encoder_tokenizer(resolved), {})
    if os.path.isdir(resolved):
        from tokenmill.model.safetensors_loader import HFCheckpoint

        cfg = HFCheckpoint(resolved).model_config()
        return ModelInfo(cfg, Tokenizer.from_hf_folder(resolved, cfg), model_generation_defaults(resolved))
    from tokenmill.model.gguf_loader import GGUFFile

    gf = GGUFFile(resolved)
    gf.check_supported()
    return ModelInfo(gf.model_config(), Tokenizer.from_gguf_metadata(gf.metadata),
                     model_generation_defaults(resolved, gf.metadata))


def load_metadata(path: str | None = None) -> tuple[ModelConfig, Tokenizer | None]:
    """The architecture and tokenizer without the weights."""
    info = load_model_info(path)
    return info.config, info.tokenizer
