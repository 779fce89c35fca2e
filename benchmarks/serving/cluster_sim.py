"""A discrete-event model of a tokenmill cluster: goodput against replicas and routing.

Each replica is modelled as our engine schedules: up to `max_num_seqs` running, a step
budget of `max_num_batched_tokens`, decode tokens first and prefill chunks after,
prompt blocks found in the replica's own prefix cache (LRU over its KV blocks) not
prefilled again. A step takes `a + b * decode_tokens + c * prefill_tokens` seconds;
a, b and c are measured on this machine with our engine (--calibrate: one thread, the
embedded model, what one replica of `cluster serve` gets here). Requests are routed
by the real router (tokenmill.cluster.routing), so the model predicts what the code
would do, not what an idealised policy would.

The workload is the issue's: tenants, each with its own long system prompt, asking
short questions (Poisson arrivals). Goodput counts requests meeting both objectives
(TTFT and TPOT).

    .venv/bin/python -m benchmarks.serving.cluster_sim --calibrate      # measure a, b, c (about a minute)
    .venv/bin/python -m benchmarks.serving.cluster_sim [--json out.json] # the tables, from the last calibration

`--quick` (the tests' smoke run): a small calibration in the run itself (not saved), then
20 requests per replica on 1 and 2 replicas.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.servers import ROOT
from tokenmill.cluster.routing import Router, prefix_chain

CALIBRATION = ROOT / "bench-results" / "cluster" / "steptime.json"
BLOCK = 16


@dataclass(frozen=True)
class StepTime:
    a: float  # seconds per step
    b: float  # per decode token
    c: float  # per prefill token

    def __call__(self, decode: int, prefill: int) -> float:
        return self.a + self.b * decode + self.c * prefill


@dataclass
class Req:
    rid: int
    arrival: float
    tenant: int
    ids: list[int]
    output: int
    replica: int = -1
    to_prefill: int = 0
    done_tokens: int = 0
    first: float | None = None
    finish: float | None = None
    cached: int = 0


@dataclass
class Replica:
    idx: int
    kv_blocks: int
    cache: OrderedDict = field(default_factory=OrderedDict)  # chain hash -> None, LRU
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy_until: float = 0.0
    stepping: bool = False

    def lookup(self, req: Req) -> int:
        chain = prefix_chain(req.ids, BLOCK, req.tenant, 1 << 30)
        n = 0
        for h in chain:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            n += 1
        return min(n * BLOCK, len(req.ids) - 1)

    def insert(self, req: Req) -> None:
        for h in prefix_chain(req.ids, BLOCK, req.tenant, 1 << 30):
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.kv_blocks:
            self.cache.popitem(last=False)


def workload(tenants: int, system_tokens: int, user_tokens: int, output: int, rate: float, n: int,
             seed: int) -> list[Req]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 49000) for _ in range(system_tokens)] for _ in range(tenants)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tenant = rng.randrange(tenants)
        out.append(Req(i, t, tenant, systems[tenant] + [rng.randrange(100, 49000) for _ in range(user_tokens)],
                       output))
    return out


def simulate(reqs: list[Req], replicas: int, policy: str, step: StepTime, max_num_seqs: int = 16,
             budget: int = 512, kv_blocks: int = 2048, imbalance: int = 4, seed: int = 0) -> list[Req]:
    router = Router(policy, block_size=BLOCK, imbalance=imbalance, rng=random.Random(seed))
    reps = [Replica(i, kv_blocks) for i in range(replicas)]
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, index)
    seq = 0
    for r in reqs:
        heapq.heappush(events, (r.arrival, seq, "arrive", r.rid))
        seq += 1

    def start_step(rep: Replica, now: float) -> None:
        nonlocal seq
        while rep.waiting and len(rep.running) < max_num_seqs:  # admit: look up its cache now
            r = rep.waiting.popleft()
            r.cached = rep.lookup(r)
            r.to_prefill = len(r.ids) - r.cached
            rep.running.append(r)
        if not rep.running:
            rep.stepping = False
            return
        decode = [r for r in rep.running if r.to_prefill == 0]
        room = budget - len(decode)
        prefill = 0
        for r in rep.running:
            if r.to_prefill and room > 0:
                take = min(r.to_prefill, room)
                r.to_prefill -= take
                room -= take
                prefill += take
                if r.to_prefill == 0:
                    r.done_tokens = -1  # its first token comes with this step
        dt = step(len(decode), prefill)
        rep.stepping = True
        heapq.heappush(events, (now + dt, seq, "step", rep.idx))
        seq += 1

    while events:
        now, _, kind, i = heapq.heappop(events)
        if kind == "arrive":
            r = reqs[i]
            choice = router.choose(list(range(replicas)), r.ids, (r.tenant, None))
            router.sent(choice)
            r.replica = choice
            rep = reps[choice]
            rep.waiting.append(r)
            if not rep.stepping:
                start_step(rep, now)
            continue
        rep = reps[i]
        still = []
        for r in rep.running:
            if r.to_prefill:
                still.append(r)
                continue
            if r.done_tokens == -1:  # prefill finished this step: first token
                r.first = now
                r.done_tokens = 1
                rep.insert(r)
            else:
                r.done_tokens += 1
            if r.done_tokens >= r.output:
                r.finish = now
                router.done(rep.idx)
            else:
                still.append(r)
        rep.running = still
        start_step(rep, now)
    return reqs


def summarize(reqs: list[Req], ttft_s: float, tpot_s: float, replicas: int) -> dict:
    ttft = sorted(r.first - r.arrival for r in reqs)
    tpot = [(r.finish - r.first) / max(1, r.output - 1) for r in reqs]
    span = max(r.finish for r in reqs) - min(r.arrival for r in reqs)
    met = sum(1 for r, p in zip(reqs, tpot) if r.first - r.arrival <= ttft_s and p <= tpot_s)
    cached = sum(r.cached for r in reqs)
    total = sum(len(r.ids) for r in reqs)
    return {"replicas": replicas, "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "prefix_hit_rate": cached / total, "goodput_rps": met / span, "met": met, "requests": len(reqs)}


def calibrate(threads: int, quick: bool = False) -> StepTime:
    """a, b, c from our engine: decode-only runs at several batch sizes (per-step time
    against running sequences) and a long prefill (per-token time)."""
    import numpy as np
    import torch

    from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenmill.engine.api import SamplingParams
    from tokenmill.engine.llm import LLM
    from tokenmill.model.loader import load_model
    from tokenmill.model.registry import resolve

    torch.set_num_threads(threads)
    loaded = load_model(resolve(None), "bfloat16", "auto")
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.25, enable_prefix_caching=False),
                                          scheduler=SchedulerConfig(max_num_seqs=32)))
    rng = random.Random(0)
    xs, ys = [], []
    tokens = 8 if quick else 48
    # repeated sizes: a noisy machine shows in the residuals
    for n in ((1, 4) if quick else (1, 2, 4, 8, 16, 1, 4, 16)):
        prompts = [[rng.randrange(100, 49000) for _ in range(4)] for _ in range(n)]
        res = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        per_step = statistics.median(
            (o.outputs[0].times.tokens[-1] - o.outputs[0].times.tokens[0]) / (tokens - 1) for o in res)
        xs.append(n)
        ys.append(per_step)
    b, a = np.polyfit(xs, ys, 1)
    pre = []
    length = 64 if quick else 512
    for _ in range(1 if quick else 3):
        prompt = [rng.randrange(100, 49000) for _ in range(length)]
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        pre.append((time.perf_counter() - t - a) / length)
    return StepTime(float(max(a, 0.0)), float(max(b, 0.0)), float(statistics.median(pre)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="threads per replica when calibrating")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rate-per-replica", type=float, default=5.0, help="requests/s offered per replica")
    ap.add_argument("--pressure-rate-per-replica", type=float, default=2.0,
                    help="the cache-pressure scenario's requests/s per replica")
    ap.add_argument("--requests-per-replica", type=int, default=400)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-ms", type=float, default=60.0)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per replica")
    ap.add_argument("--many-tenants", type=int, default=64, help="the cache-pressure scenario's tenants")
    ap.add_argument("--small-kv-blocks", type=int, default=400, help="the cache-pressure scenario's KV blocks")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="smoke run: a small unsaved calibration, 20 requests "
                                                         "per replica, 1 and 2 replicas")
    args = ap.parse_args()
    replica_counts = (1, 2, 4, 8)
    if args.quick:
        args.requests_per_replica, replica_counts = 20, (1, 2)
        st = calibrate(args.threads, quick=True)
        cal = {"a": st.a, "b": st.b, "c": st.c, "threads": args.threads, "quick": True}
    elif args.calibrate:
        st = calibrate(args.threads)
        CALIBRATION.parent.mkdir(parents=True, exist_ok=True)
        CALIBRATION.write_text(json.dumps({"a": st.a, "b": st.b, "c": st.c, "threads": args.threads}))
        print(f"step time = {st.a * 1000:.2f} ms + {st.b * 1000:.3f} ms x decode tokens + "
              f"{st.c * 1000:.4f} ms x prefill tokens (one replica, {args.threads} thread(s)); wrote {CALIBRATION}")
        return
    elif not CALIBRATION.exists():
        sys.exit("no calibration yet: run python -m benchmarks.serving.cluster_sim --calibrate first")
    else:
        cal = json.loads(CALIBRATION.read_text())
        st = StepTime(cal["a"], cal["b"], cal["c"])
    print(f"step time = {st.a * 1000:.2f} ms + {st.b * 1000:.3f} ms x decode + {st.c * 1000:.4f} ms x prefill "
          f"tokens; {args.system_tokens}-token system prompts, {args.user_tokens}-token "
          f"questions, {args.output_tokens}-token answers; objectives TTFT <= {args.ttft_ms:.0f} ms, "
          f"TPOT <= {args.tpot_ms:.0f} ms")
    rows = []
    scenarios = [(args.tenants, args.kv_blocks, args.rate_per_replica,
                  "room for every tenant's system prompt on every replica"),
                 (args.many_tenants, args.small_kv_blocks, args.pressure_rate_per_replica,
                  f"cache pressure: a replica holds about {args.small_kv_blocks * BLOCK // args.system_tokens} of "
                  f"the {args.many_tenants} system prompts")]
    for tenants, kv_blocks, rate, what in scenarios:
        print(f"\n{tenants} tenants, {kv_blocks} KV blocks per replica ({what}); {rate} req/s per replica "
              "offered\n")
        print("| replicas | routing | prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) | goodput (req/s) | "
              "goodput / replica |")
        print("|---|---|---|---|---|---|---|")
        for replicas in replica_counts:
            n = args.requests_per_replica * replicas
            for policy in ("affinity", "round_robin", "p2c"):
                if replicas == 1 and policy != "affinity":
                    continue
                reqs = workload(tenants, args.system_tokens, args.user_tokens, args.output_tokens,
                                rate * replicas, n, seed=replicas)
                simulate(reqs, replicas, policy, st, kv_blocks=kv_blocks)
                s = summarize(reqs, args.ttft_ms / 1000, args.tpot_ms / 1000, replicas)
                s.update(routing=policy, tenants=tenants, kv_blocks=kv_blocks, rate_per_replica=rate)
                rows.append(s)
                print(f"| {replicas} | {policy if replicas > 1 else '-'} | {s['prefix_hit_rate']:.2f} | "
                      f"{s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['goodput_rps']:.2f} | "
                      f"{s['goodput_rps'] / replicas:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"step": cal, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
