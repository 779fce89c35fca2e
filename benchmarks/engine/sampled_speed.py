"""Sampled against greedy single-stream decode through the offline engine (the server's
code path), default configuration: temperature 1 (the API's default) vs temperature 0,
256 tokens after a 128-token prompt, repeats interleaved, medians and their ratio.

    python -m benchmarks.engine.sampled_speed [--repeat 5] [--tokens 256] [--concurrency 1] [--quick]

Greedy and sampled decodes, truncated ones (top-k, top-p, min-p) included, all run in
native bursts (SchedulerConfig.decode_steps), truncating inside the native draw
(csrc/sampling.h). `--quick` (the tests' smoke run): 16 tokens, one round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.config import CacheConfig, EngineConfig, default_num_threads
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.model.loader import load_model

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temperature 1, top_p 0.9": dict(temperature=1.0, top_p=0.9),
    "temperature 0.7, top_k 40, top_p 0.95": dict(temperature=0.7, top_k=40, top_p=0.95),
    "temperature 1, min_p 0.05": dict(temperature=1.0, min_p=0.05),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, one round")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeat = 16, 1
    torch.set_num_threads(default_num_threads())
    llm = LLM(load_model(None, "bfloat16", "int4"), config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.5)))
    prompt = [1000 + (7 * i) % 20000 for i in range(128)]

    def run(mode: str, seed: int) -> float:
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=seed, **MODES[mode])
        prompts = [prompt + [i] for i in range(args.concurrency)]
        t = time.perf_counter()
        llm.generate(prompts, sp)
        return args.concurrency * args.tokens / (time.perf_counter() - t)

    for mode in MODES:
        run(mode, 0)  # warm-up
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeat):
        for mode in MODES:
            rates[mode].append(run(mode, r + 1))
    base = statistics.median(rates["greedy"])
    print(f"decode, {args.concurrency} stream(s), {args.tokens} tokens, median of {args.repeat}")
    print("| mode | tok/s | vs greedy |\n|---|---|---|")
    for mode, v in rates.items():
        med = statistics.median(v)
        print(f"| {mode} | {med:.0f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
