"""Single-stream speed of the model: load time, prefill tokens/s (a 512-token prompt) and
decode tokens/s (256 tokens), for tokenmill and for transformers' generate() on the same
dequantized weights, in the same run, as ratios; and batch-1 decode against the
memory-bandwidth bound (bytes of weights one decode step reads / measured copy bandwidth).

    python -m benchmarks.engine.model_speed [--dtypes float32,bfloat16,int4] [--repeat 3] [--quick]
    python -m benchmarks.engine.model_speed --model qwen2.5-coder-1.5b   # another GGUF: the bound table

Each figure is the median of --repeat runs after one warm-up. tokenmill runs through its
offline engine (paged KV, the same code path the server uses) in its default configuration,
where greedy decode steps run in native bursts (SchedulerConfig.decode_steps); the int4 bound
row is repeated one step at a time to show what that buys, and on an int8 KV cache. transformers runs eager
attention with its own dynamic KV cache. `--quick` (the tests' smoke run): int4 only (not
its one-step and int8-KV variants), a 32-token prompt, 8 tokens, one run, no transformers
runs (loading its GGUF takes ~25 s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import CONFIGS, eval_ids, load_reference
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig, default_num_threads
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.model.loader import load_model


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = eval_ids(tokenizer)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def ours(name: str, prompt: list[int], decode_tokens: int, repeat: int,
         decode_steps: int = SchedulerConfig.decode_steps, kv_cache_dtype: str = "auto",
         copy_mb: int = 1024, model: str | None = None) -> dict[str, float]:
    dtype, quant = CONFIGS[name]
    t0 = time.perf_counter()
    # another model (--model) runs as the server runs it: its file's own blocks (auto)
    loaded = load_model(model, dtype, quant if model is None else "auto")
    load_s = time.perf_counter() - t0
    # No prefix caching: every run must prefill the whole prompt.
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.25, enable_prefix_caching=False,
                                                            kv_cache_dtype=kv_cache_dtype),
                                          scheduler=SchedulerConfig(decode_steps=decode_steps)))
    prefill, decode, bandwidth, of_bound = [], [], [], []
    step_bytes = loaded.model.weight_bytes
    for i in range(repeat + 1):
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
        p = len(prompt) / (time.perf_counter() - t)
        # The machine's speed drifts by tens of percent over minutes (shared hosts): the
        # bound is measured on both sides of each decode run (their mean: one sample alone
        # drifts away from the second the run lasts) and the ratio taken run by run.
        before = copy_bandwidth(copy_mb)
        res = llm.generate(prompt, SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True))
        bw = (before + copy_bandwidth(copy_mb)) / 2
        times = res[0].outputs[0].times
        d = (decode_tokens - 1) / (times.finished - times.first_token)
        if i:  # the first run is a warm-up
            prefill.append(p)
            decode.append(d)
            bandwidth.append(bw)
            of_bound.append(d / (bw / step_bytes))
    return {"load_s": load_s, "prefill": statistics.median(prefill), "decode": statistics.median(decode),
            "step_bytes": step_bytes, "bandwidth": statistics.median(bandwidth),
            "of_bound": statistics.median(of_bound)}


_COPY_BUFFERS: list[torch.Tensor] = []


def copy_bandwidth(mb: int = 1024, repeat: int = 5) -> float:
    """Memory bandwidth in bytes/s as a large tensor copy sees it (read + write counted)."""
    if not _COPY_BUFFERS:
        _COPY_BUFFERS.extend([torch.empty(mb * 2**20, dtype=torch.uint8).fill_(1),
                              torch.empty(mb * 2**20, dtype=torch.uint8)])
    src, dst = _COPY_BUFFERS
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def reference(dtype: str, prompt: list[int], decode_tokens: int, repeat: int) -> dict[str, float]:
    t0 = time.perf_counter()
    model = load_reference(dtype)
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt])
    prefill, decode = [], []
    with torch.inference_mode():
        for i in range(repeat + 1):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            pre_s = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
            total_s = time.perf_counter() - t
            if i:
                prefill.append(len(prompt) / pre_s)
                decode.append((decode_tokens - 1) / max(total_s - pre_s, 1e-9))
    return {"load_s": load_s, "prefill": statistics.median(prefill), "decode": statistics.median(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16,int4")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bound-only", action="store_true",
                    help="only the bandwidth-bound table (no transformers reference runs)")
    ap.add_argument("--quick", action="store_true", help="smoke run: int4, 32 + 8 tokens, one run, no "
                                                         "transformers")
    ap.add_argument("--model", default=None,
                    help="another GGUF (a path or an installed model's name): the bandwidth-bound table alone, "
                         "its weights run as the server runs them (--quantization auto)")
    args = ap.parse_args()
    if args.model is not None:
        from tokenmill.model.registry import resolve

        args.model, args.bound_only, args.dtypes = resolve(args.model), True, "int4"
    copy_mb = 1024
    if args.quick:
        args.dtypes, args.prompt_tokens, args.decode_tokens, args.repeat = "int4", 32, 8, 1
        args.bound_only, copy_mb = True, 64
    torch.set_num_threads(default_num_threads())
    if args.model is None:
        tok = load_model(None, "float32").tokenizer
    else:
        from tokenmill.model.gguf_loader import GGUFFile
        from tokenmill.model.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf_metadata(GGUFFile(args.model).metadata)
    prompt = prompt_ids(tok, args.prompt_tokens)
    print(f"threads {torch.get_num_threads()}, prompt {len(prompt)} tokens, decode {args.decode_tokens} tokens, "
          f"median of {args.repeat}")
    header = ("| config | load s (tm / hf) | prefill tok/s (tm / hf) | ratio | decode tok/s (tm / hf) | ratio |\n"
              "|---|---|---|---|---|---|")
    rows, bound_rows = [], []
    for name in args.dtypes.split(","):
        a = ours(name, prompt, args.decode_tokens, args.repeat, copy_mb=copy_mb, model=args.model)
        # transformers has no counterpart of our int4 kernels: that row compares with its bf16
        b = None if args.bound_only else reference(CONFIGS[name][0], prompt, args.decode_tokens, args.repeat)
        if b:
            rows.append(f"| {name} | {a['load_s']:.2f} / {b['load_s']:.2f} | {a['prefill']:.0f} / {b['prefill']:.0f} | "
                        f"{a['prefill'] / b['prefill']:.2f}x | {a['decode']:.1f} / {b['decode']:.1f} | "
                        f"{a['decode'] / b['decode']:.2f}x |")
            print(rows[-1], flush=True)
        runs = [(name, a)]  # the default: greedy decode steps in bursts (SchedulerConfig.decode_steps)
        if SchedulerConfig.decode_steps > 1 and name == "int4" and not args.quick and args.model is None:
            # what the native multi-step loop buys: the same engine, one step at a time
            runs.append((f"{name}, one step at a time (decode_steps=1)",
                         ours(name, prompt, args.decode_tokens, args.repeat, 1, copy_mb=copy_mb)))
            # half the K/V bytes for decode attention to read (the bound counts weights only)
            runs.append((f"{name}, int8 KV cache", ours(name, prompt, args.decode_tokens, args.repeat,
                                                       kv_cache_dtype="int8", copy_mb=copy_mb)))
        for label, r in runs:
            bound = r["bandwidth"] / r["step_bytes"]
            bound_rows.append(f"| {label} | {r['step_bytes'] / 1e6:.0f} | {r['bandwidth'] / 1e9:.1f} | {bound:.0f} | "
                              f"{r['decode']:.1f} | {r['of_bound']:.0%} |")
    print("\nbatch-1 decode vs the memory-bandwidth bound (copy bandwidth: the mean of one measured before and"
          " one after each decode run; of bound: median of the runs' ratios)")
    print("| config | weight MB read per step | copy GB/s | bound tok/s | measured tok/s | of bound |\n"
          "|---|---|---|---|---|---|")
    print("\n".join(bound_rows))
    if rows:
        print()
        print(header)
        print("\n".join(rows))


if __name__ == "__main__":
    main()
