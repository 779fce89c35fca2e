"""Overhead of the HTTP path, and where the step loop should run.

Same prompt, same config, one run: the offline engine (no HTTP) against the server
with its step loop in a thread (`--engine thread`) and in a child process
(`--engine process`): single-stream decode tokens/s and TTFT, and output tokens/s
at 16 concurrent streams.

    .venv/bin/python benchmarks/server_overhead.py [--dtype bfloat16 --quantization int4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODEL = "SmolLM2-135M-Instruct"


def offline(dtype: str, quant: str, max_tokens: int, repeats: int) -> tuple[float, float]:
    from tokenmill.config import CacheConfig, EngineConfig, ModelOptions
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.api import SamplingParams
    from tokenmill.model.loader import load_model

    engine = LLMEngine(load_model(None, dtype, quant),
                       EngineConfig(model=ModelOptions(dtype=dtype, quantization=quant),
                                    cache=CacheConfig(kv_cache_gb=0.25, enable_prefix_caching=False)))
    ids = engine.tokenizer.encode(PROMPT)
    rates, ttfts = [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        engine.add_request(f"r{r}", ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        first = None
        while engine.has_unfinished():
            outs = engine.step()
            if first is None and outs:
                first = time.perf_counter()
        if r:  # the first run warms up
            rates.append((max_tokens - 1) / (time.perf_counter() - first))
            ttfts.append((first - t0) * 1000)
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


async def through_server(url: str, max_tokens: int, repeats: int) -> tuple[float, float, float]:
    async with httpx.AsyncClient(timeout=300) as client:
        await stream_one(client, url, 8)
        single = [await stream_one(client, url, max_tokens) for _ in range(repeats)]
        t0 = time.perf_counter()
        many = await asyncio.gather(*[stream_one(client, url, max_tokens) for _ in range(16)])
        wall = time.perf_counter() - t0
    return (statistics.median(r for r, _, _ in single), statistics.median(t for _, t, _ in single),
            sum(n for _, _, n in many) / wall)


def serve(mode: str, dtype: str, quant: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--engine", mode,
                             "--dtype", dtype, "--quantization", quant, "--kv-cache-gb", "0.5",
                             "--log-level", "warning", "--no-prefix-caching"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rate, ttft = offline(args.dtype, args.quantization, args.max_tokens, args.repeats)
    print(f"config: {args.dtype}/{args.quantization}, {args.max_tokens} output tokens, medians of {args.repeats}")
    print(f"{'path':22} {'decode tok/s':>12} {'TTFT ms':>8} {'c=16 out tok/s':>15}")
    print(f"{'offline engine':22} {rate:12.1f} {ttft:8.1f} {'':>15}")
    for mode in ("thread", "process"):
        proc, url = serve(mode, args.dtype, args.quantization)
        try:
            r, t, c16 = asyncio.run(through_server(url, args.max_tokens, args.repeats))
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"{'server, ' + mode:22} {r:12.1f} {t:8.1f} {c16:15.1f}   "
              f"(decode {r / rate:.2f}x offline)")


if __name__ == "__main__":
    main()
