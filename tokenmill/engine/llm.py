"""Offline batch generation: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.types import Choice, RequestOutput, SamplingParams, TokenLogprob
from tokenmill.engine.front import generation_defaults
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.model.metadata import load_model_info


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Choice]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    def __init__(self, model: str | LoadedModel | None = None, dtype: str = "float32",
                 config: EngineConfig | None = None, quantization: str = "none",
                 activation_levels: int | None = None):
        """A request's silent fields get the model's generation defaults, as the server's
        do (a LoadedModel passed in has none)."""
        config = config or EngineConfig()
        defaults = None
        if isinstance(model, LoadedModel):
            loaded = model
        else:
            loaded = load_model(model, dtype, quantization, activation_levels)
            defaults = generation_defaults(load_model_info(model).generation, config.model)
        self.engine = LLMEngine(loaded, config, defaults)
        self.tokenizer = loaded.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: list[str | list[int]] | str | list[int],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt, sp in zip(prompts, plist):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, sp)
            results[rid] = GenerationResult(rid, ids, [Choice(i) for i in range(sp.n)])
            order.append(rid)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._merge(results[out.request_id], out)
        return [results[r] for r in order]

    @staticmethod
    def _merge(res: GenerationResult, out: RequestOutput) -> None:
        res.outputs[out.index].add(out)
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        if out.index == 0:
            res.num_cached_tokens = out.num_cached_tokens
