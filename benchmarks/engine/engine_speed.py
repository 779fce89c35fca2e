"""tokenmill's offline engine measured the way llama-bench measures llama.cpp: pp512 (a
512-token prompt's prefill, tok/s) and tg128 (128 tokens decoded one at a time at batch 1,
tok/s), on one GGUF file in the default configuration (`--quantization auto`), with no
server in between. `benchmarks/compare` runs it beside `llama-bench -p 512 -n 128`.

    .venv/bin/python -m benchmarks.engine.engine_speed [--model FILE] [--threads 2] [--repeat 5] [--quick]

Prints one JSON line: {"pp512": ..., "tg128": ..., "quantization": ..., "load_s": ...}; each
figure is the median of --repeat runs after a warm-up. The prompt is distinct each run and
prefix caching is off, so every run prefills all of it. tg128 starts from a one-token
prompt, as llama-bench's does. The default model is the embedded one. `--quick` (the
tests' smoke run): a 64-token prompt, 16 tokens, one run after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.model.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 + 16 tokens, one run")
    args = ap.parse_args()
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.repeat = 64, 16, 1
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model, "bfloat16", "auto")
    load_s = time.perf_counter() - t0
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.25, enable_prefix_caching=False),
                                          scheduler=SchedulerConfig()))
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    pp, tg = [], []
    for i in range(args.repeat + 1):
        # random ids, as llama-bench's prompts are
        prompt = torch.randint(100, vocab, (args.prompt_tokens,), generator=gen).tolist()
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        pp_s = time.perf_counter() - t
        res = llm.generate([[int(prompt[0])]], SamplingParams(max_tokens=args.decode_tokens + 1, temperature=0,
                                                              ignore_eos=True))
        times = res[0].outputs[0].times
        if i:  # the first run is a warm-up
            pp.append(args.prompt_tokens / pp_s)
            tg.append(args.decode_tokens / (times.finished - times.first_token))
    print(json.dumps({"pp512": statistics.median(pp), "tg128": statistics.median(tg),
                      "quantization": loaded.quantization, "load_s": load_s,
                      "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                      "repeat": args.repeat}))


if __name__ == "__main__":
    main()
