"""Overhead of the HTTP path, and where the step loop should run.

Same prompt, same config, one run: the offline engine (no HTTP) against the server
with its step loop in a thread (`--engine thread`) and in a child process
(`--engine process`): single-stream decode tokens/s and TTFT, and output tokens/s
at 16 concurrent streams.

    .venv/bin/python -m benchmarks.serving.server_overhead [--dtype bfloat16 --quantization int4] [--quick]

`--quick` (the tests' smoke run): 16 output tokens, one run, 4 concurrent streams.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.servers import RunningServer, ServerSpec, serve_cmd
from tokenmill.config import CacheConfig, EngineConfig, ModelOptions
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.model.loader import load_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODEL = "SmolLM2-135M-Instruct"


def offline(dtype: str, quant: str, max_tokens: int, repeats: int) -> tuple[float, float]:
    """Single-stream decode tok/s and TTFT ms of the offline engine (medians after a warm-up)."""
    llm = LLM(load_model(None, dtype, quant), config=EngineConfig(
        model=ModelOptions(dtype=dtype, quantization=quant),
        cache=CacheConfig(kv_cache_gb=0.25, enable_prefix_caching=False)))
    rates, ttfts = [], []
    for r in range(repeats + 1):
        [res] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        times = res.outputs[0].times
        if r:  # the first run warms up
            rates.append((max_tokens - 1) / (times.finished - times.first_token))
            ttfts.append((times.first_token - times.arrival) * 1000)
    return statistics.median(rates), statistics.median(ttfts)


async def stream_one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, float, int]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    n = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                n += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return (n - 1) / (end - first), (first - t0) * 1000, n


async def through_server(url: str, max_tokens: int, repeats: int, streams: int) -> tuple[float, float, float]:
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        await stream_one(client, url, 8)
        single = [await stream_one(client, url, max_tokens) for _ in range(repeats)]
        t0 = time.perf_counter()
        many = await asyncio.gather(*[stream_one(client, url, max_tokens) for _ in range(streams)])
        wall = time.perf_counter() - t0
    return (statistics.median(r for r, _, _ in single), statistics.median(t for _, t, _ in single),
            sum(n for _, _, n in many) / wall)


def spec(mode: str, dtype: str, quant: str) -> ServerSpec:
    return ServerSpec(f"server-{mode}", serve_cmd("--engine", mode, "--dtype", dtype, "--quantization", quant,
                                                  "--kv-cache-gb", "0.5", "--log-level", "warning",
                                                  "--no-prefix-caching"), "/ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams of the throughput column")
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, one run, 4 streams")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.repeats, args.streams = 16, 1, 4
    rate, ttft = offline(args.dtype, args.quantization, args.max_tokens, args.repeats)
    print(f"config: {args.dtype}/{args.quantization}, {args.max_tokens} output tokens, medians of {args.repeats}")
    column = f"c={args.streams} out tok/s"
    print(f"{'path':22} {'decode tok/s':>12} {'TTFT ms':>8} {column:>15}")
    print(f"{'offline engine':22} {rate:12.1f} {ttft:8.1f} {'':>15}")
    logs = Path(tempfile.mkdtemp(prefix="server-overhead-"))
    for mode in ("thread", "process"):
        with RunningServer(spec(mode, args.dtype, args.quantization), logs) as srv:
            r, t, many = asyncio.run(through_server(srv.base_url, args.max_tokens, args.repeats, args.streams))
        print(f"{'server, ' + mode:22} {r:12.1f} {t:8.1f} {many:15.1f}   "
              f"(decode {r / rate:.2f}x offline)")
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
