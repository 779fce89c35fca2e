"""A/B of two tokenmill versions through the HTTP API, interleaved in one run.

The baseline is a git ref checked out into a worktree (.bench-worktrees/, ignored) and
served with this venv (its own source first on PYTHONPATH); the candidate is this
checkout. Rounds alternate A and B, each server started fresh; medians and B/A ratios:

- single-stream decode tokens/s, greedy and sampled (temperature 1, seeded), 256 tokens
- output tokens/s at 16 concurrent streams (64 requests, 128 tokens each)

    .venv/bin/python -m benchmarks.race.ab_servers --baseline ed0775a --rounds 3 [-- serve flags]

`--quick` (the tests' smoke run) measures this checkout alone (B; no baseline, no
worktree), one round, 32-token answers, 4 concurrent streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.servers import ROOT, free_port

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def worktree(ref: str) -> Path:
    path = ROOT / ".bench-worktrees" / ref
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True,
                       capture_output=True)
    return path


class Server:
    def __init__(self, src: Path, flags: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(src)}
        (ROOT / ".bench-worktrees").mkdir(exist_ok=True)
        self.log = open(ROOT / ".bench-worktrees" / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(self.port), "--log-level", "warning",
             "--kv-cache-gb", "0.5", *flags], cwd=src, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server from {src} exited; see {self.log.name}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.log.close()


async def stream_rate(client: httpx.AsyncClient, url: str, max_tokens: int, temperature: float,
                      seed: int | None) -> float:
    """Decode tokens/s of one streamed answer (first token to last)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
            elif msg["choices"] and msg["choices"][0]["text"]:
                now = time.perf_counter()
                first = first or now
                last = now
    return (tokens - 1) / (last - first)


async def concurrent_rate(client: httpx.AsyncClient, url: str, concurrency: int, requests: int,
                          max_tokens: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    total = 0

    async def one(i: int) -> None:
        nonlocal total
        async with sem:
            r = await client.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": f"{PROMPT} ({i})", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 1.0, "seed": i})
            total += r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    return total / (time.perf_counter() - t0)


async def measure(url: str, quick: bool) -> dict[str, float]:
    tokens, streams, concurrency, requests, tokens16 = (32, 1, 4, 8, 16) if quick else (256, 3, 16, 64, 128)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64), trust_env=False) as client:
        await stream_rate(client, url, 16, 0.0, None)  # warm-up
        greedy = statistics.median([await stream_rate(client, url, tokens, 0.0, None) for _ in range(streams)])
        sampled = statistics.median([await stream_rate(client, url, tokens, 1.0, s) for s in range(streams)])
        many = await concurrent_rate(client, url, concurrency, requests, tokens16)
    return {"greedy decode tok/s (c=1)": greedy, "sampled decode tok/s (c=1)": sampled,
            f"output tok/s (c={concurrency})": many}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="git ref of version A (required unless --quick)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: this checkout alone, one round, "
                                                         "short answers")
    ap.add_argument("flags", nargs="*", help="tokenmill serve flags for both")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    elif not args.baseline:
        ap.error("--baseline is required (or --quick)")
    # --quick: this checkout alone (B), no baseline worktree
    srcs = {"B": ROOT} if args.quick else {"A": worktree(args.baseline), "B": ROOT}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in srcs}
    for rnd in range(args.rounds):
        for name in (sorted(srcs) if rnd % 2 == 0 else sorted(srcs, reverse=True)):
            srv = Server(srcs[name], args.flags)
            try:
                results[name].append(asyncio.run(measure(srv.url, args.quick)))
            finally:
                srv.stop()
            print(f"round {rnd + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[name][-1].items()),
                  flush=True)
    if "A" not in results:
        print(f"\nB = this checkout (--quick: no baseline); medians of {args.rounds} rounds")
        for key in results["B"][0]:
            print(f"{key:30s} B {statistics.median(r[key] for r in results['B']):8.1f}")
        return
    print(f"\nA = {args.baseline}, B = this checkout; medians of {args.rounds} interleaved rounds")
    for key in results["A"][0]:
        a = statistics.median(r[key] for r in results["A"])
        b = statistics.median(r[key] for r in results["B"])
        print(f"{key:30s} A {a:8.1f}  B {b:8.1f}  B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
