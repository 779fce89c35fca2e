"""The prefix cache's disk tier under a multi-turn agent trace: many conversations on long
shared system prompts, each turn resending the whole history, with more KV than the memory
pool holds. The same trace (same seed) is replayed through `tokenmill bench`'s agent
workload (its Python API: the same HTTP seam as the command) against two servers this
script starts one after the other on the embedded model with a small `--kv-cache-gb`:

- **tier off**: memory only: a conversation whose history was evicted while it was away
  recomputes it;
- **tier on**: `--kv-disk-dir` (a fresh temporary directory) under the same pool: it reads
  the history back from disk instead (from the OS page cache where it still holds the
  files, as it will on a machine with free memory).

Printed: TTFT p50/p99, mean ITL, goodput under the objectives, the share of prompt tokens
served from cache (server usage), tokens read back from disk, preemptions, and the on/off
ratios; then TTFT by turn. The trace's KV (its distinct tokens: the shared prefixes and
every conversation's history) is set beside the pool so a reader sees it does not fit.

    python -m benchmarks.serving.agent_trace [--quick] [--json out.json] [--conversations 24 --turns 4 ...]

Check that nothing else runs first: on two cores one stray process skews every figure.
`--quick` (the tests' smoke run): 6 conversations of 3 short turns on a 192-token prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from benchmarks.servers import RunningServer, ServerSpec, serve_cmd
from tokenmill.bench.client import ClientConfig
from tokenmill.bench.harness import BenchConfig, run_benchmark
from tokenmill.bench.runner import RunSpec
from tokenmill.bench.stats import Slo
from tokenmill.bench.workload import AgentConfig, LengthDist, WorkloadConfig

MODEL = "SmolLM2-135M-Instruct"
# every conversation open at once, histories gone from memory between turns, the machine
# below capacity (docs/benchmarks.md: shapes that break either condition show no gain)
FULL = dict(conversations=24, turns=4, concurrency=24, prefix_len=1500, num_prefixes=2, user_len=200,
            answer_len=32, think_time=20.0, kv_cache_gb=0.15)
# a pool of ~540 tokens: one request fits, the live conversations' histories do not
QUICK = dict(conversations=6, turns=3, concurrency=4, prefix_len=192, num_prefixes=1, user_len=24,
             answer_len=8, think_time=0.5, kv_cache_gb=0.012)


def scrape(base_url: str) -> dict[str, float]:
    """The server's /metrics as {name: value} (unlabelled samples only)."""
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=30, trust_env=False).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(m: dict[str, float], name: str) -> Optional[float]:
    return m.get(name, m.get(name + "_total"))


def trace_tokens(run: dict[str, Any], agent: AgentConfig) -> int:
    """About how many distinct tokens of KV the trace made: each conversation's last prompt
    and answer, counting each shared system prompt (about `prefix_len` tokens: one a word)
    once."""
    last: dict[int, dict[str, Any]] = {}
    for r in run["requests"]:
        if r["ok"] and r["prompt_tokens"] and r["turn"] >= last.get(r["conversation"], {"turn": -1})["turn"]:
            last[r["conversation"]] = r
    total = sum(r["prompt_tokens"] + r["output_tokens"] for r in last.values())
    return total - agent.prefix_len * max(0, len(last) - agent.num_prefixes)


def arm(name: str, args: argparse.Namespace, workload: WorkloadConfig, work: Path,
        disk_dir: Optional[Path]) -> dict[str, Any]:
    tier = ["--kv-disk-dir", str(disk_dir), "--kv-disk-gb", str(args.kv_disk_gb)] if disk_dir else []
    spec = ServerSpec(name=name, ready_path="/ready", cmd=serve_cmd(
        "--kv-cache-gb", str(args.kv_cache_gb), "--log-level", "warning", "--no-batch-api",
        "--shutdown-timeout", "5", *shlex.split(args.server_args), *tier))
    assert workload.agent is not None
    with RunningServer(spec, work) as srv:
        cfg = BenchConfig(
            client=ClientConfig(base_url=srv.base_url, model=MODEL, endpoint="chat", request_timeout_s=600),
            workload=workload, runs=(RunSpec("closed", workload.agent.num_requests, concurrency=args.concurrency),),
            slo=Slo(args.slo_ttft_ms, args.slo_itl_ms), warmup=1, command=" ".join(sys.argv))
        watch = srv.watch()
        run = run_benchmark(cfg)["runs"][0]
        other = watch.other_cores()
        m = scrape(srv.base_url)
    return {"run": run, "other_cores": other, "metrics": {
        "kv_blocks_total": metric(m, "tokenmill_kv_blocks_total"),
        "preemptions": metric(m, "tokenmill_preemptions"),
        "disk_hit_tokens": metric(m, "tokenmill_kv_disk_hit_tokens"),
        "disk_faults": metric(m, "tokenmill_kv_disk_faults"),
        "disk_used_bytes": metric(m, "tokenmill_kv_disk_used_bytes")}}


def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(on: Optional[float], off: Optional[float]) -> str:
    return f"{on / off:.2f}x" if on is not None and off else "-"


def table(off: dict[str, Any], on: dict[str, Any], args: argparse.Namespace) -> list[str]:
    a, b = off["run"], on["run"]
    slo = f"TTFT <= {args.slo_ttft_ms:g} ms, mean ITL <= {args.slo_itl_ms:g} ms"
    lines = ["| measure | tier off | tier on | on / off |", "|---|---|---|---|",
             f"| requests ok / sent | {a['num_ok']}/{a['num_requests']} | {b['num_ok']}/{b['num_requests']} | - |"]

    def row(label: str, get: Callable[[dict[str, Any]], Optional[float]], fmt: str, ratio: bool = True) -> None:
        x, y = get(off), get(on)  # of an arm: its "run" summary and its server's "metrics"
        lines.append(f"| {label} | {_f(x, fmt)} | {_f(y, fmt)} | {_ratio(y, x) if ratio else '-'} |")

    row("TTFT p50, ms", lambda d: d["run"]["ttft_ms"]["p50"], ".0f")
    row("TTFT p99, ms", lambda d: d["run"]["ttft_ms"]["p99"], ".0f")
    row("ITL mean, ms", lambda d: d["run"]["itl_ms"]["mean"], ".1f")
    row(f"goodput, req/s ({slo})", lambda d: d["run"]["goodput_rps"], ".3f")
    row("requests meeting the objectives", lambda d: d["run"]["num_good"], "d")
    row("requests/s", lambda d: d["run"]["requests_per_s"], ".3f")
    row("prompt tokens served from cache", lambda d: d["run"]["cached_token_share"], ".1%")
    row("of which read back from disk, tokens", lambda d: d["metrics"]["disk_hit_tokens"] or 0, ".0f", False)
    row("preemptions", lambda d: d["metrics"]["preemptions"], ".0f", False)
    row("wall time, s", lambda d: d["run"]["duration_s"], ".1f")
    lines += ["", "TTFT by turn, ms (p50; cached share)", "", "| turn | tier off | tier on |", "|---|---|---|"]
    for t in a["by_turn"] or {}:
        x, y = a["by_turn"][t], (b["by_turn"] or {}).get(t)
        cell = lambda v: "-" if v is None else (  # noqa: E731
            f"{_f(v['ttft_ms']['p50'], '.0f')} ({_f(v['cached_token_share'], '.0%')})")
        lines.append(f"| {t} | {cell(x)} | {cell(y)} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in FULL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None, help=f"default {value}")
    ap.add_argument("--kv-disk-gb", type=float, default=4.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=500.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="more `tokenmill serve` options for both servers")
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny trace")
    ap.add_argument("--json", type=Path, help="write both arms' results here")
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    agent = AgentConfig(conversations=args.conversations, turns=args.turns, prefix_len=args.prefix_len,
                        num_prefixes=args.num_prefixes, think_time_s=args.think_time)
    workload = WorkloadConfig(input_len=LengthDist(args.user_len), output_len=LengthDist(args.answer_len),
                              seed=args.seed, agent=agent)
    work = Path(tempfile.mkdtemp(prefix="tokenmill-agent-trace-"))
    t0 = time.monotonic()
    off = arm("tier-off", args, workload, work, None)
    disk = work / "kv"
    try:
        on = arm("tier-on", args, workload, work, disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    pool_tokens = int(off["metrics"]["kv_blocks_total"] or 0) * 16
    kv_tokens = trace_tokens(off["run"], agent)
    print(f"agent trace, {MODEL} (default mode), `tokenmill bench` agent workload over /v1/chat/completions: "
          f"{agent.conversations} conversations x {agent.turns} turns, {args.concurrency} at a time, "
          f"{agent.num_prefixes} shared system prompt{'s' if agent.num_prefixes > 1 else ''} of "
          f"{agent.prefix_len} tokens, user messages of "
          f"{args.user_len} and answers of {args.answer_len} tokens, think time mean {agent.think_time_s:g} s; "
          f"seed {args.seed}")
    print(f"memory pool (--kv-cache-gb {args.kv_cache_gb:g}): {pool_tokens} tokens; the trace's KV: about "
          f"{kv_tokens} distinct tokens ({kv_tokens / max(1, pool_tokens):.1f}x the pool)\n")
    print("\n".join(table(off, on, args)))
    print(f"\n(other processes kept {_f(off['other_cores'], '.1f')} / {_f(on['other_cores'], '.1f')} of "
          f"{os.cpu_count()} cores busy during tier off / on)")
    print(f"both arms, server starts included: {time.monotonic() - t0:.0f} s; server logs: {work}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "pool_tokens": pool_tokens, "trace_tokens": kv_tokens,
                                         "off": off, "on": on}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
