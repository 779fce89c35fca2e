"""What the engine benchmarks share: the evaluation text, the named configurations and
transformers' reference model."""

from __future__ import annotations

import os

TEXT = os.path.join(os.path.dirname(__file__), "data", "eval_text.txt")
CONFIGS = {  # name -> (dtype, quantization)
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
}


def eval_ids(tokenizer) -> list[int]:
    """The evaluation text as token ids."""
    with open(TEXT, encoding="utf-8") as f:
        return tokenizer.encode(f.read())


def load_reference(dtype: str):
    """transformers' model from the embedded GGUF, in eval mode: the baseline."""
    import torch
    import transformers

    from tokenmill.model.loader import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)).eval()
