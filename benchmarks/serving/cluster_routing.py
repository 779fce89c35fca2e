"""Routing across replicas, measured through `tokenmill cluster serve` (Ray Serve):

1. **Policies**: 8 tenants (each its own API key, so its own cache salt), each with its
   own long system prompt, asking short questions (Poisson arrivals, one schedule for
   every policy). For affinity, round robin and power of two choices, each on a fresh
   cluster of 2 replicas (one thread each): the prefix-cache hit rate (prompt tokens
   served from cache, summed over the replicas' counters), TTFT p50/p99 and the
   replicas' share of requests. The KV cache per replica is small on purpose
   (--kv-cache-gb): one replica holds about five tenants' system prompts, as a large
   model's cache holds a few of many tenants; with room for all of them everywhere,
   every policy hits alike after the first request per tenant and replica.
2. **Ingress overhead**: single-stream TTFT and decode tok/s through the cluster
   (1 replica, 2 threads) against `tokenmill serve` (2 threads), both up at once,
   requests alternated between them.

    .venv/bin/python -m benchmarks.serving.cluster_routing [--quick] [--only policies|overhead] [--json out.json]

Check that nothing else runs first: on two cores one stray process skews every figure.
`--quick` (the tests' smoke run) starts no Ray cluster: the same tenants, keys and
metrics against one `tokenmill serve` ("routing" none), and the overhead part's serve
side alone, with a handful of short requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.servers import RunningServer, ServerSpec, serve_cmd
from tokenmill.bench.client import ClientConfig, RequestRecord, send_request
from tokenmill.bench.runner import make_client
from tokenmill.bench.workload import RequestSpec

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("affinity", "round_robin", "p2c")


def words(rng: random.Random, n: int) -> str:
    vocab = ("bread flour oven crust yeast butter sugar salt water honey rye wheat loaf bake dough knead "
             "proof shelf order price morning evening sunday delivery cake tart pie cream fruit nut seed").split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def spec(name: str, args: list[str], cluster: bool) -> ServerSpec:
    return ServerSpec(name=name, cmd=serve_cmd("--log-level", "warning", "--no-batch-api", *args, cluster=cluster),
                      ready_path="/ready")


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def replica_requests(m: dict[str, float]) -> list[float]:
    return sorted(v for k, v in m.items() if k.startswith("tokenmill_replica_requests_total{"))


async def play(url: str, keys: list[str], schedule: list[tuple[float, int, RequestSpec]]) -> list[RequestRecord]:
    configs = [ClientConfig(base_url=url, model=MODEL, endpoint="chat", api_key=k) for k in keys]
    client = make_client(configs[0], len(schedule))
    t0 = time.perf_counter()

    async def one(at: float, tenant: int, s: RequestSpec) -> RequestRecord:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        return await send_request(client, configs[tenant], s, t0)

    try:
        return list(await asyncio.gather(*(one(*item) for item in schedule)))
    finally:
        await client.aclose()


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def run_policies(args, log_dir: Path) -> list[dict]:
    rng = random.Random(args.seed)
    db = Path(tempfile.mkdtemp(prefix="cluster-bench-")) / "keys.db"
    keys = []
    for t in range(args.tenants):
        r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "keys", "add", f"tenant{t}", "--db", str(db)],
                           capture_output=True, text=True, check=True)
        keys.append(r.stdout.strip())
    systems = [f"You are the assistant of bakery number {t}. " + words(rng, args.system_words)
               for t in range(args.tenants)]
    schedule, t = [], 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        tenant = rng.randrange(args.tenants)
        messages = [{"role": "system", "content": systems[tenant]},
                    {"role": "user", "content": f"Question {i}: " + words(rng, args.question_words)}]
        schedule.append((t, tenant, RequestSpec(index=i, prompt="", max_tokens=args.output_tokens,
                                                messages=messages)))
    rows = []
    for policy in args.policies:
        flags = ["--num-threads", "1", "--keys-db", str(db), "--kv-cache-gb", str(args.kv_cache_gb)]
        if policy != "none":  # "none": one `tokenmill serve`, no Ray (--quick)
            flags += ["--replicas", "2", "--routing", policy]
        with RunningServer(spec(f"cluster-{policy}", flags, policy != "none"), log_dir) as srv:
            before = metrics(srv.base_url)
            recs = asyncio.run(play(srv.base_url, keys, schedule))
            time.sleep(1.5)  # the replicas' last reports
            after = metrics(srv.base_url)
        ok = [r for r in recs if r.ok]
        hits = after["tokenmill_prefix_cache_hits_tokens"] - before["tokenmill_prefix_cache_hits_tokens"]
        queries = after["tokenmill_prefix_cache_queries_tokens"] - before["tokenmill_prefix_cache_queries_tokens"]
        split = [a - b for a, b in zip(replica_requests(after), replica_requests(before))]
        ttft = [r.ttft_ms for r in ok]
        row = {"routing": policy, "ok": len(ok), "sent": len(recs), "prefix_hit_rate": hits / queries if queries else 0,
               "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": pct(ttft, 99),
               "e2e_p50_ms": statistics.median(r.e2e_ms for r in ok), "replica_split": split, "load_s": srv.load_s}
        rows.append(row)
        print(f"  {policy:12s} hit rate {row['prefix_hit_rate']:.2f}  TTFT p50 {row['ttft_p50_ms']:.0f} ms  "
              f"p99 {row['ttft_p99_ms']:.0f} ms  ok {len(ok)}/{len(recs)}  split {split}", flush=True)
    return rows


def run_overhead(args, log_dir: Path) -> dict:
    rng = random.Random(args.seed + 1)
    targets = {"serve": spec("serve", ["--num-threads", "2"], False)}
    if not args.quick:  # --quick starts no Ray cluster
        targets["cluster"] = spec("cluster-1x2", ["--replicas", "1", "--num-threads", "2"], True)
    out: dict[str, dict[str, list[float]]] = {name: {"ttft": [], "tps": []} for name in targets}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(RunningServer(s, log_dir)).base_url for name, s in targets.items()}
        asyncio.run(_alternate(args, rng, urls, out))
    res = {k: {"ttft_p50_ms": statistics.median(v["ttft"]), "decode_tok_s": statistics.median(v["tps"]),
               "n": len(v["ttft"])} for k, v in out.items()}
    if "cluster" in res:
        res["ratio"] = {"ttft": res["cluster"]["ttft_p50_ms"] / res["serve"]["ttft_p50_ms"],
                        "decode": res["cluster"]["decode_tok_s"] / res["serve"]["decode_tok_s"]}
    return res


async def _alternate(args, rng: random.Random, urls: dict[str, str], out: dict) -> None:
    """Rounds of single-stream requests, the servers' order swapped each round."""
    cfgs = {name: ClientConfig(base_url=url, model=MODEL, endpoint="completions") for name, url in urls.items()}
    clients = {name: make_client(cfg, 1) for name, cfg in cfgs.items()}
    try:
        for round_ in range(args.rounds + 1):  # the first round warms both up
            order = list(urls) if round_ % 2 == 0 else list(urls)[::-1]
            for name in order:
                for i in range(args.stream_requests):
                    s = RequestSpec(index=i, prompt=words(rng, 110), max_tokens=args.stream_tokens)
                    rec = await send_request(clients[name], cfgs[name], s, time.perf_counter())
                    if round_ and rec.ok:
                        out[name]["ttft"].append(rec.ttft_ms)
                        out[name]["tps"].append(rec.decode_tokens_per_s)
    finally:
        for c in clients.values():
            await c.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("policies", "overhead"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=300, help="about 1.3 tokens a word")
    ap.add_argument("--question-words", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s")
    ap.add_argument("--kv-cache-gb", type=float, default=0.05, help="per replica")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--stream-requests", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.policies, args.tenants, args.system_words, args.requests, args.rate = ["none"], 2, 60, 6, 4.0
        args.output_tokens, args.rounds, args.stream_requests, args.stream_tokens = 8, 1, 1, 16
    log_dir = Path(tempfile.mkdtemp(prefix="cluster-routing-"))
    result: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if args.only in (None, "policies"):
        print(f"policies: {args.tenants} tenants, ~{args.system_words}-word system prompts, {args.requests} "
              f"requests at {args.rate}/s, {args.output_tokens}-token answers; "
              f"{'one tokenmill serve (--quick: no Ray)' if args.quick else '2 replicas'} x 1 thread, "
              f"--kv-cache-gb {args.kv_cache_gb} each", flush=True)
        rows = result["policies"] = run_policies(args, log_dir)
        print("\n| routing | prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | requests per replica |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['routing']} | {r['prefix_hit_rate']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
                  f"| {r['e2e_p50_ms']:.0f} | {' / '.join(f'{x:.0f}' for x in r['replica_split'])} |")
    if args.only in (None, "overhead"):
        o = result["overhead"] = run_overhead(args, log_dir)
        print("\n| path | TTFT p50 (ms) | decode tok/s (median) | requests |")
        print("|---|---|---|---|")
        for name, label in (("serve", "`tokenmill serve` (2 threads)"),
                            ("cluster", "`tokenmill cluster serve` (1 replica x 2 threads)")):
            if name not in o:
                continue
            print(f"| {label} | {o[name]['ttft_p50_ms']:.0f} | {o[name]['decode_tok_s']:.1f} | {o[name]['n']} |")
        if "ratio" in o:
            print(f"\ncluster / serve: TTFT {o['ratio']['ttft']:.2f}x, decode {o['ratio']['decode']:.2f}x")
    print(f"\nserver logs: {log_dir}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
