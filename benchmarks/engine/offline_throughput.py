"""Offline throughput: output tokens/s for a batch of requests (default 64 prompts of
~200 tokens, 128 output tokens each) through tokenmill's engine, against transformers'
generate() run one request at a time on the same weights in the same run; then a sweep
of max_num_seqs.

    python -m benchmarks.engine.offline_throughput [--configs float32,int4] [--sweep 1,4,16,64] [--quick]

Sequential transformers runs every request alike, so its rate is measured on the first
--hf-requests requests (default 8) rather than all 64; the ratio compares rates.
`--quick` (the tests' smoke run): int4, 4 prompts of ~32 tokens, 8 output tokens, a sweep
of 1 and 4, no transformers runs (loading its GGUF takes ~25 s).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import CONFIGS, eval_ids, load_reference
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig, default_num_threads
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.model.loader import load_model


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of length-20..length+20 tokens (length/2..length*3/2 below
    40): windows over a fixed text."""
    ids = eval_ids(tokenizer)
    spread = min(20, length // 2)
    prompts = []
    for i in range(count):
        n = length - spread + (i * 7) % (2 * spread + 1)
        start = (i * 37) % max(1, len(ids) - n)
        prompts.append(ids[start:start + n])
    return prompts


def ours(loaded, prompts, out_tokens: int, max_num_seqs: int) -> float:
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=1.0, enable_prefix_caching=False),
                                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)))
    params = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[0][:32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(r.outputs[0].token_ids) for r in res)
    assert produced == len(prompts) * out_tokens
    return produced / elapsed


def reference(dtype: str, prompts, out_tokens: int) -> float:
    model = load_reference(dtype)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:32]]), max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        for p in prompts:
            model.generate(torch.tensor([p]), max_new_tokens=out_tokens, min_new_tokens=out_tokens, do_sample=False)
        elapsed = time.perf_counter() - t
    return len(prompts) * out_tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="float32,int4")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=8)
    ap.add_argument("--sweep", default="1,4,16,64", help="max_num_seqs values, run with the last config")
    ap.add_argument("--quick", action="store_true", help="smoke run: int4, 4 x (32 + 8) tokens, sweep 1,4, "
                                                         "no transformers")
    args = ap.parse_args()
    if args.quick:
        args.configs, args.requests, args.prompt_tokens, args.output_tokens = "int4", 4, 32, 8
        args.sweep, args.hf_requests = "1,4", 0
    torch.set_num_threads(default_num_threads())
    prompts = make_prompts(load_model(None, "float32").tokenizer, args.requests, args.prompt_tokens)
    mean_len = sum(map(len, prompts)) / len(prompts)
    print(f"threads {torch.get_num_threads()}, {len(prompts)} requests, mean prompt {mean_len:.0f} tokens, "
          f"{args.output_tokens} output tokens each")
    rows = []
    configs = args.configs.split(",")
    for name in configs:
        dtype, quant = CONFIGS[name]
        a = ours(load_model(None, dtype, quant), prompts, args.output_tokens, max(64, len(prompts)))
        if args.hf_requests:
            b = reference(dtype, prompts[:args.hf_requests], args.output_tokens)
            rows.append(f"| {name} | {a:.0f} | {b:.1f} (transformers {dtype}, sequential) | {a / b:.1f}x |")
        else:
            rows.append(f"| {name} | {a:.0f} | - (transformers not run) | - |")
        print(rows[-1], flush=True)
    print("\n| config | tokenmill output tok/s | baseline output tok/s | ratio |\n|---|---|---|---|")
    print("\n".join(rows))

    name = configs[-1]
    loaded = load_model(None, *CONFIGS[name])
    sweep = []
    for seqs in (int(s) for s in args.sweep.split(",")):
        rate = ours(loaded, prompts, args.output_tokens, seqs)
        sweep.append((seqs, rate))
        print(f"max_num_seqs {seqs}: {rate:.0f} output tok/s", flush=True)
    base = sweep[0][1]
    print(f"\n| max_num_seqs ({name}) | output tok/s | vs {sweep[0][0]} |\n|---|---|---|")
    for seqs, rate in sweep:
        print(f"| {seqs} | {rate:.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
