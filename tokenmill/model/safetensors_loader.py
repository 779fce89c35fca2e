"""Read a Hugging Face checkpoint folder: config.json plus one or many *.safetensors."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator

import torch

from tokenmill.model.config import ModelConfig, ModelLoadError
from tokenmill.model.lazy_weights import LazyWeights


class HFCheckpoint:
    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = os.fspath(folder)
        cfg_path = os.path.join(self.folder, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelLoadError(f"no config.json in model folder {self.folder}")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                self.hf_config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{cfg_path} is not valid JSON: {exc}") from None
        self.files = sorted(
            os.path.join(self.folder, n) for n in os.listdir(self.folder) if n.endswith(".safetensors")
        )
        if not self.files:
            raise ModelLoadError(f"no *.safetensors files in model folder {self.folder}")

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_config(self.hf_config, name=os.path.basename(os.path.normpath(self.folder)))

    def state_dict(self, cfg: ModelConfig) -> LazyWeights:
        """name -> float32 tensor for every weight, each read when asked. Gemma's norms
        scale by 1 + w: the 1 is added here, as llama.cpp's conversion does, so every norm is
        a plain scale."""
        from safetensors import SafetensorError, safe_open

        makers, shapes = {}, {}
        for path in self.files:
            try:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        makers[key] = functools.partial(self._tensor, path, key, cfg.architecture == "gemma3")
                        shapes[key] = tuple(f.get_slice(key).get_shape())
            except SafetensorError as exc:
                raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from None
        return LazyWeights(makers, shapes)

    @staticmethod
    def _tensor(path: str, key: str, shift: bool) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as f:
                t = f.get_tensor(key).float()
        except SafetensorError as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from None
        return t + 1.0 if shift and key.endswith("norm.weight") else t

    def iter_state_dict(self, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, float32 tensor) for every weight, one at a time."""
        weights = self.state_dict(cfg)
        for name in weights:
            yield name, weights[name]
