"""What automatic prefix caching saves.

1. TTFT of a 1500-token prompt cold (nothing cached) vs warm (the same 1500-token prefix
   cached by an earlier request, a new question after it), as a ratio.
2. Total throughput of a workload where 90% of every prompt is one shared system prompt,
   prefix caching on vs off, in the same run.

    python -m benchmarks.engine.prefix_cache [--config int4] [--repeat 3] [--quick]

`--quick` (the tests' smoke run): a 128-token prompt, one round, 4 requests of 128 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import CONFIGS, eval_ids
from tokenmill.config import CacheConfig, EngineConfig, default_num_threads
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.model.loader import load_model


def corpus(tokenizer) -> list[int]:
    ids = eval_ids(tokenizer)
    while len(ids) < 8000:
        ids = ids + list(reversed(ids))  # long enough for distinct windows; content is irrelevant
    return ids


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    res = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    times = res[0].outputs[0].times
    return times.first_token - times.arrival, res[0].num_cached_tokens


def cold_vs_warm(loaded, ids: list[int], length: int, repeat: int) -> tuple[float, float, int]:
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=1.0)))
    ttft(llm, ids[:64])  # warm-up
    cold, warm, cached = [], [], 0
    for i in range(repeat):
        prefix = ids[500 * i + 7:500 * i + 7 + length]  # a new prefix each round: nothing cached
        question = ids[7000 + 13 * i:7000 + 13 * i + 12]
        t, c = ttft(llm, prefix + question)
        assert c == 0, c
        cold.append(t)
        t, cached = ttft(llm, prefix + question[::-1])  # same prefix, a different question
        warm.append(t)
    return statistics.median(cold), statistics.median(warm), cached


def shared_prompt_workload(loaded, ids: list[int], caching: bool, requests: int, prompt_len: int,
                           out_tokens: int) -> tuple[float, float]:
    shared = ids[:int(prompt_len * 0.9)]
    tail = prompt_len - len(shared)
    prompts = [shared + ids[3000 + i * tail:3000 + (i + 1) * tail] for i in range(requests)]
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=1.0, enable_prefix_caching=caching)))
    llm.generate(ids[5000:5032], SamplingParams(max_tokens=2, temperature=0))  # warm-up, unrelated prompt
    t = time.perf_counter()
    res = llm.generate(prompts, SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True))
    elapsed = time.perf_counter() - t
    tokens = sum(len(p) for p in prompts) + sum(len(r.outputs[0].token_ids) for r in res)
    return requests / elapsed, tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="int4", choices=sorted(CONFIGS))
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--workload-prompt-tokens", type=int, default=1000)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="smoke run: 128-token prompts, one round, 4 requests")
    args = ap.parse_args()
    if args.quick:
        args.prompt_tokens, args.repeat, args.requests = 128, 1, 4
        args.workload_prompt_tokens, args.output_tokens = 128, 4
    torch.set_num_threads(default_num_threads())
    loaded = load_model(None, *CONFIGS[args.config])
    ids = corpus(loaded.tokenizer)
    print(f"config {args.config}, threads {torch.get_num_threads()}")

    cold, warm, cached = cold_vs_warm(loaded, ids, args.prompt_tokens, args.repeat)
    print(f"\n| {args.prompt_tokens}-token prompt | TTFT ms |\n|---|---|")
    print(f"| cold | {cold * 1000:.0f} |\n| warm ({cached} tokens cached) | {warm * 1000:.0f} |")
    print(f"| cold / warm | {cold / warm:.1f}x |")

    rows = {}
    for caching in (False, True):
        rows[caching] = shared_prompt_workload(loaded, ids, caching, args.requests, args.workload_prompt_tokens,
                                               args.output_tokens)
    print(f"\n{args.requests} requests, {args.workload_prompt_tokens}-token prompts (90% shared), "
          f"{args.output_tokens} output tokens each")
    print("| prefix caching | requests/s | tokens/s (prompt + output) |\n|---|---|---|")
    for caching, (rps, tps) in rows.items():
        print(f"| {'on' if caching else 'off'} | {rps:.2f} | {tps:.0f} |")
    print(f"| on / off | {rows[True][0] / rows[False][0]:.1f}x | |")


if __name__ == "__main__":
    main()
