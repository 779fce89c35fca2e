"""Quality cost of a model configuration: perplexity on a fixed text set and greedy
(top-1) token agreement with the float32 reference, teacher-forced through the engine's
own prompt-logprob path.

    python -m benchmarks.engine.quality --configs float32,bfloat16,int8,int4 [--decode-kernels] [--kv-int8]
                                        [--decode-path] [--tokens N] [--quick]

Teacher forcing runs the prompt path, where quantized layers use their dense bf16 copy
(the quantized weights, bf16 activations). With --decode-kernels every quantized layer
is forced onto its small-batch kernel instead, which on AVX-512 VNNI machines also
rounds the activations to int8: the quality that decode steps actually get. Those
configurations print with a "+dk" suffix. With --kv-int8 each configuration also runs on
an int8 KV cache ("+kv8"): the prompt then attends over the dequantized keys and values,
as every later token does. With --decode-path each configuration is also teacher-forced
through single-token decode steps ("+decode"): every token of the text goes through the
kernels a decode step runs (the fused native step where it applies, its attention over
the cache included), not the prompt path's. `--quick` (the tests' smoke run): float32 and
int4 on the text's first 48 tokens, both paths.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from benchmarks.common import CONFIGS, TEXT
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.engine.llm_engine import LLMEngine  # the decode path below drives the model itself
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.loader import load_model


@dataclass
class Quality:
    perplexity: float
    top1: list[int]

    def agreement(self, ref: "Quality") -> float:
        return sum(a == b for a, b in zip(self.top1, ref.top1)) / len(ref.top1)


def load_config(name: str, path: str | None = None, decode_kernels: bool = False):
    dtype, quant = CONFIGS[name]
    loaded = load_model(path, dtype, quant)
    if decode_kernels:
        for lin in loaded.model.linears():
            if hasattr(lin, "dense_from_rows"):
                lin.dense_from_rows = 1 << 62
    return loaded


def text_ids(loaded, text_path: str, tokens: int | None) -> list[int]:
    with open(text_path, encoding="utf-8") as f:
        return loaded.tokenizer.encode(f.read())[:tokens]


def evaluate(loaded, text_path: str = TEXT, kv_cache_dtype: str = "auto", tokens: int | None = None) -> Quality:
    ids = text_ids(loaded, text_path, tokens)
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(num_blocks=-(-len(ids) // 16) + 4,
                                                            enable_prefix_caching=False,
                                                            kv_cache_dtype=kv_cache_dtype)))
    [res] = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    scored = [lp for lp in res.prompt_logprobs[1:]]
    nll = -sum(lp.logprob for lp in scored) / len(scored)
    return Quality(math.exp(nll), [lp.top[0][0] for lp in scored])


def evaluate_decode(loaded, text_path: str = TEXT, kv_cache_dtype: str = "auto",
                    tokens: int | None = None) -> Quality:
    """The text teacher-forced one token a step as decode steps (token i at position i,
    attending over tokens 0..i in the cache), scoring each step's logits."""
    import torch

    ids = text_ids(loaded, text_path, tokens)
    bs = 16
    nblocks = -(-len(ids) // bs)
    engine = LLMEngine(loaded, EngineConfig(cache=CacheConfig(block_size=bs, num_blocks=nblocks,
                                                              enable_prefix_caching=False,
                                                              kv_cache_dtype=kv_cache_dtype)))
    model, cache, kernel = loaded.model, engine.kv_cache, engine.runner.kernel
    table = torch.arange(nblocks).view(1, -1)
    nll, top1 = 0.0, []
    for i in range(len(ids) - 1):
        meta = AttentionMetadata(slot_mapping=torch.tensor([i]), num_decodes=1, block_tables=table,
                                 seq_lens=torch.tensor([i + 1]), kernel=kernel, block_size=bs)
        if kernel is None:
            meta.decode_slots = torch.arange(i + 1).view(1, -1)
            meta.decode_mask = torch.ones(1, 1, 1, i + 1, dtype=torch.bool)
        tok, pos = torch.tensor([ids[i]]), torch.tensor([i])
        fused = engine.runner.fused.logits(tok, pos, meta) if engine.runner.fused else None
        logits = fused[0] if fused is not None else model.logits(model.forward(tok, pos, meta, cache))
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        nll -= float(lp[ids[i + 1]])
        top1.append(int(lp.argmax()))
    return Quality(math.exp(nll / (len(ids) - 1)), top1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--configs", default="float32,bfloat16,int8,int4")
    ap.add_argument("--model", default=None)
    ap.add_argument("--decode-kernels", action="store_true",
                    help="also evaluate each quantized config through its small-batch kernels")
    ap.add_argument("--kv-int8", action="store_true", help="also evaluate each config on an int8 KV cache")
    ap.add_argument("--decode-path", action="store_true",
                    help="also evaluate each config (and its int8 KV cache with --kv-int8) through decode steps")
    ap.add_argument("--tokens", type=int, default=None, help="score only the text's first N tokens")
    ap.add_argument("--quick", action="store_true", help="smoke run: float32 and int4, 48 tokens, both paths")
    args = ap.parse_args()
    if args.quick:
        args.configs, args.tokens, args.decode_path = "float32,int4", args.tokens or 48, True
    ref = None
    print(f"{'config':18} {'perplexity':>10} {'vs fp32':>8} {'top-1 agree':>11}")
    names = args.configs.split(",")
    runs = [(name, False, "auto", False) for name in names]
    if args.decode_kernels:
        runs += [(name, True, "auto", False) for name in names if CONFIGS[name][1] != "none"]
    if args.kv_int8:
        runs += [(name, False, "int8", False) for name in names]
    if args.decode_path:
        runs += [(name, False, kv, True) for kv in (("auto", "int8") if args.kv_int8 else ("auto",)) for name in names]
    for name, dk, kv, dp in runs:
        loaded = load_config(name, args.model, dk)
        q = (evaluate_decode(loaded, kv_cache_dtype=kv, tokens=args.tokens) if dp
             else evaluate(loaded, kv_cache_dtype=kv, tokens=args.tokens))
        ref = ref or q
        label = name + ("+dk" if dk else "") + ("+kv8" if kv == "int8" else "") + ("+decode" if dp else "")
        print(f"{label:18} {q.perplexity:10.3f} {100 * (q.perplexity / ref.perplexity - 1):+7.2f}% "
              f"{100 * q.agreement(ref):10.2f}%", flush=True)


if __name__ == "__main__":
    main()
