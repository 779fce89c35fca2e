"""What two int8 levels of activations in o_proj and gate_up cost in decode speed: the
default model against the same model with those layers switched back to one level,
greedy, C=1 (256 tokens) and C=16 (64 tokens each), repeats interleaved, medians.

    python benchmarks/precision_speed.py [--repeat 3]

(Their fidelity: benchmarks/fidelity.py and docs/benchmarks.md.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tokenmill.config import CacheConfig, EngineConfig, default_num_threads  # noqa: E402
from tokenmill.engine.api import SamplingParams  # noqa: E402
from tokenmill.engine.llm import LLM  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402


def make(one_level: bool) -> LLM:
    loaded = load_model(None, "bfloat16", "int4")
    if one_level:  # before the fused step is built, which reads these flags once
        for layer in loaded.model.layers:
            layer.o_proj.precise = False
            layer.gate_up.precise = False
    return LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.5)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(default_num_threads())
    llms = {"two levels (default)": make(False), "one level in o_proj, gate_up": make(True)}
    prompt = [1000 + i for i in range(128)]

    def run(llm: LLM, n: int, tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([prompt + [i] for i in range(n)], sp)
        return n * tokens / (time.perf_counter() - t)

    for llm in llms.values():
        run(llm, 1, 16)
    res = {k: {1: [], 16: []} for k in llms}
    for _ in range(args.repeat):
        for k, llm in llms.items():
            res[k][1].append(run(llm, 1, 256))
            res[k][16].append(run(llm, 16, 64))
    print("| activations | C=1 tok/s | C=16 tok/s |\n|---|---|---|")
    for k in llms:
        print(f"| {k} | {statistics.median(res[k][1]):.0f} | {statistics.median(res[k][16]):.0f} |")


if __name__ == "__main__":
    main()
