"""tokenmill's offline engine measured the way llama-bench measures llama.cpp: pp512 (a
512-token prompt's prefill, tok/s) and tg128 (128 tokens decoded one at a time at batch 1,
tok/s), on one GGUF file in the default configuration (`--quantization auto`), with no
server in between. `benchmarks/compare` runs it beside `llama-bench -p 512 -n 128`.

    .venv/bin/python benchmarks/engine_speed.py --model FILE [--threads 2] [--repeat 5]

Prints one JSON line: {"pp512": ..., "tg128": ..., "quantization": ..., "load_s": ...}; each
figure is the median of --repeat runs after a warm-up. The prompt is distinct each run and
prefix caching is off, so every run prefills all of it. tg128 starts from a one-token
prompt, as llama-bench's does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from tokenmill.engine.api import SamplingParams  # noqa: E402
from tokenmill.engine.llm import LLM  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()
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
