"""Speculative decoding, measured through the HTTP API: the same prompts, in one run, on
three servers of the default mode that differ only in `--speculative off|ngram|suffix`.

Workloads (benchmarks/data, prompts written for this benchmark):
- grounded: answers that quote their input (copy a passage, edit a given code file,
  quote a given document): spec_grounded.jsonl;
- open: open-ended chat with nothing to copy: spec_open.jsonl.
Each at concurrency 1 (one stream, prompts one after another) and 16 (a closed loop of
16 clients over the workload's prompts). Greedy answers of up to --max-tokens tokens,
ended where the model ends them: the answers are the same on the three servers (checked
and reported), so each server makes the same tokens.

Per (workload, concurrency, server): output tok/s (tokens / wall time of the phase), its
ratio to off, TPOT p50 (a request's (E2E - TTFT) / (tokens - 1): its time per output
token; chunks carry several tokens when drafts are accepted, so per-chunk gaps would
flatter speculation), TTFT p50, and from /metrics the drafts checked, the share accepted
and the mean accepted length (tokens per step that checked a request's drafts). Rounds
are interleaved (off, ngram, suffix, then rotated) so drift on the shared machine falls
on every server; each round uses a fresh cache_salt, so no round finds the prefix cache
or the suffix index warmed by an earlier one. Before timing, the script refuses to start
while other processes keep a core busy (--allow-busy to override).

    .venv/bin/python -m benchmarks.serving.spec_decode [--rounds 2] [--max-tokens 256] [--json out.json]

`--quick` (the tests' smoke run): 2 prompts per workload, 16 tokens, one round, C=1 and 2,
and a busy machine only warned about.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks.servers import ROOT, RunningServer, ServerSpec, busy_jiffies, clock_ticks, serve_cmd

METHODS = ("off", "ngram", "suffix")
MODEL: dict[str, str] = {}  # server url -> the model id it serves
DATA = ROOT / "benchmarks" / "data"


def load(name: str) -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in (DATA / name).read_text().splitlines() if line.strip()]


def machine_busy(seconds: float = 2.0) -> float:
    """Cores kept busy by any process over a short idle window (before servers start)."""
    a = busy_jiffies()
    time.sleep(seconds)
    return (busy_jiffies() - a) / clock_ticks() / seconds


async def one(http: httpx.AsyncClient, url: str, messages, max_tokens: int, salt: str) -> dict[str, Any]:
    body = {"model": MODEL[url], "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage: dict[str, Any] = {}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c["delta"].get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    e2e = time.perf_counter() - t0
    n = usage.get("completion_tokens", 0)
    return {"text": "".join(text), "tokens": n, "ttft": ttft, "e2e": e2e,
            "tpot": (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None}


async def metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    out = {}
    for line in (await http.get(url + "/metrics")).text.splitlines():
        if line.startswith("tokenmill_spec_") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def phase(url: str, prompts, concurrency: int, max_tokens: int, salt: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as http:
        m0 = await metrics(http, url)
        queue = list(enumerate(prompts))
        results: dict[int, dict[str, Any]] = {}

        async def worker() -> None:
            while queue:
                i, msgs = queue.pop(0)
                results[i] = await one(http, url, msgs, max_tokens, salt)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        m1 = await metrics(http, url)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    return {"wall": wall, "results": [results[i] for i in range(len(prompts))],
            "drafts": d.get("tokenmill_spec_draft_tokens_total", 0.0),
            "accepted": d.get("tokenmill_spec_accepted_tokens_total", 0.0),
            "verifications": d.get("tokenmill_spec_verifications_total", 0.0)}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for run in runs for r in run["results"])
    wall = sum(run["wall"] for run in runs)
    tpot = [r["tpot"] for run in runs for r in run["results"] if r["tpot"] is not None]
    ttft = [r["ttft"] for run in runs for r in run["results"] if r["ttft"] is not None]
    drafts = sum(run["drafts"] for run in runs)
    accepted = sum(run["accepted"] for run in runs)
    ver = sum(run["verifications"] for run in runs)
    return {"tokens": tokens, "tok_s": tokens / wall if wall else 0.0,
            "tpot_p50_ms": 1000 * statistics.median(tpot) if tpot else None,
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
            "draft_tokens": drafts, "acceptance": accepted / drafts if drafts else None,
            "mean_accepted_length": 1 + accepted / ver if ver else None}


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


async def main_async(args: argparse.Namespace, servers: dict[str, RunningServer]) -> dict[str, Any]:
    workloads = {"grounded": load("spec_grounded.jsonl"), "open": load("spec_open.jsonl")}
    if args.prompts:
        workloads = {k: v[:args.prompts] for k, v in workloads.items()}
    # warm-up: first requests pay one-time costs (kernel caches, allocator)
    for s in servers.values():
        async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
            MODEL[s.base_url] = (await http.get(s.base_url + "/v1/models")).json()["data"][0]["id"]
            await one(http, s.base_url, workloads["open"][0], 16, "warmup")
    raw: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    order = list(METHODS)
    for rnd in range(args.rounds):
        for wname, prompts in workloads.items():
            for conc in args.concurrency:
                for m in order:
                    salt = f"r{rnd}-{m}-{uuid.uuid4().hex[:8]}"
                    print(f"round {rnd + 1}: {wname} C={conc} {m}", flush=True)
                    raw.setdefault((wname, conc, m), []).append(
                        await phase(servers[m].base_url, prompts, conc, args.max_tokens, salt))
                order = order[1:] + order[:1]
    table = []
    mismatches = 0
    for (wname, conc, m), runs in raw.items():
        ref = raw[(wname, conc, "off")]
        for run, rref in zip(runs, ref):
            mismatches += sum(a["text"] != b["text"] for a, b in zip(run["results"], rref["results"]))
        s = summary(runs)
        base = summary(ref)
        s.update(workload=wname, concurrency=conc, method=m,
                 ratio=s["tok_s"] / base["tok_s"] if base["tok_s"] else None)
        table.append(s)
    return {"rows": table, "answer_mismatches_vs_off": mismatches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 prompts per workload, 16 tokens, one "
                                                         "round, C=1 and 2")
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts of each workload")
    ap.add_argument("--allow-busy", action="store_true")
    ap.add_argument("--server-args", default="", help="extra serve flags for all three servers")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens, args.concurrency, args.allow_busy = 1, 16, [1, 2], True
        args.prompts = args.prompts or 2
    busy = machine_busy(0.5 if args.quick else 2.0)
    print(f"other processes kept {busy:.2f} cores busy before the run", flush=True)
    if busy > 0.3 and not args.allow_busy:
        sys.exit("the machine is busy: stop what runs (ps aux) or pass --allow-busy")
    work = Path(tempfile.mkdtemp(prefix="tokenmill-spec-"))
    specs = {m: ServerSpec(name=f"tokenmill-{m}", ready_path="/ready",
                           cmd=serve_cmd("--speculative", m, "--no-batch-api", "--log-level", "warning",
                                         *args.server_args.split()))
             for m in METHODS}
    servers: dict[str, RunningServer] = {}
    try:
        for m, spec in specs.items():
            servers[m] = RunningServer(spec, work).__enter__()
        result = asyncio.run(main_async(args, servers))
    finally:
        for s in servers.values():
            s.stop()
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["busy_cores_before"] = busy
    print()
    print("| workload | C | speculative | output tok/s | vs off | TPOT p50 ms | TTFT p50 ms | drafts | accepted | "
          "mean accepted length |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['tok_s']:.1f} | {fmt(r['ratio'], '.2f')}x "
              f"| {fmt(r['tpot_p50_ms'], '.2f')} | {fmt(r['ttft_p50_ms'], '.0f')} | {r['draft_tokens']:.0f} "
              f"| {fmt(None if r['acceptance'] is None else 100 * r['acceptance'], '.0f')}% "
              f"| {fmt(r['mean_accepted_length'], '.2f')} |")
    print(f"\nanswers that differ from off's: {result['answer_mismatches_vs_off']} (must be 0)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
