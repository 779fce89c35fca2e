"""A model's own generation defaults: what its authors recommend for a request that says
nothing about sampling. Read from the model's metadata, never guessed:

- a GGUF file's `general.sampling.*` keys (llama.cpp writes them from the model's
  generation_config.json),
- a Hugging Face folder's `generation_config.json`,
- an installed model's recipe (tokenmill/model/registry.py), the embedded one included,
  for files that carry none.

Imports no torch. The keys are the engine's GenerationDefaults field names.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.model.config import ModelLoadError

# generation_config.json key -> ours
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF general.sampling.* -> ours
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
_INTS = ("top_k", "max_tokens")


def _clean(raw: dict[str, Any], keys: dict[str, str], source: str) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for key, ours in keys.items():
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{source}: {key} must be a number, got {v!r}")
        out[ours] = int(v) if ours in _INTS else float(v)
    return out


def from_hf_generation_config(raw: dict[str, Any], source: str = "generation_config.json") -> dict[str, float | int]:
    """Sampling defaults of a generation_config.json. A config with do_sample false asks
    for greedy decoding: its temperature and truncation are not applied (transformers
    ignores them then too)."""
    out = _clean(raw, _HF_KEYS, source)
    if raw.get("do_sample") is False:
        out = {k: v for k, v in out.items() if k in ("repetition_penalty", "max_tokens")}
        out["temperature"] = 0.0
    return out


def read_file(path: str) -> dict[str, float | int]:
    """`serve --generation-config FILE`: a generation_config.json of the operator's."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the generation config {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: a generation config is a JSON object")
    return from_hf_generation_config(raw, path)


def model_generation_defaults(path: str, gguf_metadata: dict[str, Any] | None = None) -> dict[str, float | int]:
    """The generation defaults of the model at `path`: a folder's generation_config.json; a
    GGUF's own general.sampling.* keys (`gguf_metadata`, read here when not given), else
    those of the recipe that installs the file (the embedded model's included)."""
    from tokenmill.model.registry import recipe_generation

    if os.path.isdir(path):
        file = os.path.join(path, "generation_config.json")
        return read_file(file) if os.path.isfile(file) else {}
    name = os.path.basename(path)
    if gguf_metadata is None:
        from tokenmill.model.gguf_reader import GGUFReader

        gguf_metadata = GGUFReader(path).metadata
    return _clean(gguf_metadata, _GGUF_KEYS, name) or recipe_generation(name)
