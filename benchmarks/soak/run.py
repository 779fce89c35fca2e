"""A bounded soak: mixed traffic, all features at once, against one real `tokenmill serve`
this script starts (default mode, API keys on, Batch API and capture in a fresh data
dir), sampled over time, judged at the end.

Traffic (--concurrency closed-loop clients, each picking a request kind at random, plus
one client of a rate-limited tenant and one Batch API client), over HTTP with httpx and
the openai SDK: streamed and whole chat, completions, n=2 (seeded), logprobs, json_schema
structured output, forced tool calls, clients that leave at random points (before the
first chunk, after a few, on a timer while a whole answer is made), slow readers (read a
chunk, sleep), small Batch API jobs, three tenants (keys): two whose limits must never
trip and one with --rpm that trips (its 429s are counted as expected). Every greedy and
seeded answer is checked against a reference run (each request answered once, alone,
before the load): the default mode is batch-invariant, so the same text must come back.

Every --sample-s the clients pause until the server is idle, and it samples: resident
memory, open fds and threads of each process of the server's group, KV blocks held with
nothing running, data dir and SQLite size (/metrics, /proc), the client's event-loop
lag, p50/p99 TTFT and ITL of the window's streamed requests, outcomes by kind.

It fails (exit 1, saying why) if a request ends without a terminal status (a stream
without its finish and [DONE], a hang past the request bound, a batch line never
answered), is duplicated, is answered wrongly, if resident memory or fds grow past
the thresholds in report.py between the end of the warm-up and the end, or KV blocks
stay held. --faults: SIGKILL of the engine process at a random time, later SIGSTOP (a hung
engine, for the server's watchdog to find); requests caught in each must end with a clear
error within a bound, and a good answer must come back.

    .venv/bin/python -m benchmarks.soak.run [--minutes 60] [--faults] [--json soak.json] [--plot soak.png]
    .venv/bin/python -m benchmarks.soak.run --quick [--faults]   # 3 minutes of traffic, small requests
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.servers import ROOT, RunningServer, ServerSpec, serve_cmd
from benchmarks.soak import report
from benchmarks.soak.batches import one_batch
from benchmarks.soak.faults import fault_plan, kill_engine, settle
from benchmarks.soak.probe import LoopLag, disk, metrics, processes, window_latency
from benchmarks.soak.traffic import REQUEST_TIMEOUT_S, Client, Ledger, answer_of, reference_bodies

CAPPED_RPM = 12  # the tripping tenant's limit; its client asks every CAPPED_GAP_S (40 a minute), open loop
CAPPED_GAP_S = 1.5
BATCH_LINES = 3
BACKOFF_S = 1.0
QUIESCE_S = 30.0  # how long a sample waits for the server to go idle before it reads KV blocks anyway
DRAIN_S = 120.0  # after the traffic: how long batches in progress get to finish
WARMUP_S = 300.0  # growth is judged from this far in (or WARMUP_FRACTION of a shorter run)
WARMUP_FRACTION = 0.2
HANG_TIMEOUT_S = 10.0  # --engine-hang-timeout (the server's default, said explicitly: the SIGSTOP fault's bound)


def make_keys(db: Path, concurrency: int) -> dict[str, str]:
    """Three tenants through `tokenmill keys add`, as an operator makes them."""
    out = {}
    for tenant, extra in (("alpha", ["--admin"]), ("beta", ["--max-concurrency", str(2 * concurrency)]),
                          ("capped", ["--rpm", str(CAPPED_RPM)])):
        proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "keys", "add", tenant, *extra, "--db", str(db)],
                              cwd=ROOT, capture_output=True, text=True, check=True)
        out[tenant] = proc.stdout.strip().splitlines()[-1]
    return out


class Soak:
    def __init__(self, args: argparse.Namespace, server: RunningServer, keys: dict[str, str], work: Path) -> None:
        self.args, self.server, self.keys, self.work = args, server, keys, work
        self.pgid = server.proc.pid
        self.rng = random.Random(args.seed)
        self.gate = asyncio.Event()
        self.stop = asyncio.Event()
        self.samples: list[dict] = []
        self.faults: list[dict] = []
        self.lag = LoopLag()
        self.batches_open = 0
        self.seen_outcomes = 0

    async def reference(self) -> None:
        """Each checked request answered once, alone, before any load."""
        admin = {"Authorization": f"Bearer {self.keys['alpha']}"}
        model = (await self.http.get("/v1/models", headers=admin)).json()["data"][0]["id"]
        self.bodies = reference_bodies(model, self.args.prompts, self.args.max_tokens)
        refs = {}
        for key, (path, body) in self.bodies.items():
            r = await self.http.post(path, json=body, headers=admin)
            r.raise_for_status()
            refs[key] = answer_of(path, r.json()["choices"])
        self.client = Client(self.http, refs, self.bodies, Ledger(), self.rng, self.args.prompts)

    async def quiesce(self) -> bool:
        """Hold new requests and wait until nothing runs; True if the server went idle."""
        self.gate.clear()
        deadline = time.monotonic() + QUIESCE_S
        while time.monotonic() < deadline:
            if self.client.ledger.open - self.batches_open <= 0:
                m = await metrics(self.http)
                if m.get("tokenmill_num_requests_running") == 0 and m.get("tokenmill_num_requests_waiting") == 0:
                    return True
            await asyncio.sleep(0.2)
        return False

    async def sample(self, t0: float) -> dict:
        t_q = time.monotonic()
        idle = await self.quiesce()
        m = await metrics(self.http)
        procs = processes(self.pgid)
        data_mib, sqlite_mib = disk([self.work / "data", self.work / "keys.db"])
        outcomes = self.client.ledger.outcomes
        window, self.seen_outcomes = outcomes[self.seen_outcomes:], len(outcomes)
        s = {"t_s": t_q - t0, "processes": procs, "rss_mib": sum(p["rss_mib"] for p in procs.values()),
             "fds": int(sum(p["fds"] for p in procs.values())),
             "threads": int(sum(p["threads"] for p in procs.values())),
             "kv_blocks_idle": m.get("tokenmill_kv_blocks_used") if idle else None,
             "kv_blocks_total": m.get("tokenmill_kv_blocks_total"), "data_mib": data_mib, "sqlite_mib": sqlite_mib,
             "client_lag": self.lag.take(),
             "server_lag_max_ms": 1000 * m["tokenmill_event_loop_lag_max_seconds"]
             if "tokenmill_event_loop_lag_max_seconds" in m else None,
             **window_latency(window), "outcomes": dict(Counter(o.status for o in window)),
             "engine_restarts": m.get("tokenmill_engine_restarts"),
             "http": {k[5:]: v for k, v in m.items() if k.startswith("http_")},
             "quiesce_s": time.monotonic() - t_q}
        self.samples.append(s)
        if not self.stop.is_set():
            self.gate.set()
        return s

    async def worker(self, w: int) -> None:
        rng = random.Random(self.args.seed * 1000 + w)
        while not self.stop.is_set():
            await self.gate.wait()
            if self.stop.is_set():
                return
            tenant = rng.choice(("alpha", "beta"))
            o = await self.client.one(self.client.pick(), tenant, self.keys[tenant])
            if o.status not in ("ok", "cancelled"):
                await asyncio.sleep(BACKOFF_S)  # as an SDK does before it retries (the server says Retry-After: 1)

    async def capped(self) -> None:
        """Open loop, so the tenant asks faster than its limit however slow the answers are."""
        sent: list[asyncio.Future] = []
        try:
            while not self.stop.is_set():
                await self.gate.wait()
                if self.stop.is_set():
                    break
                sent = [t for t in sent if not t.done()]
                sent.append(asyncio.ensure_future(self.client.one("capped", "capped", self.keys["capped"])))
                await asyncio.sleep(CAPPED_GAP_S)
        finally:
            await asyncio.gather(*sent, return_exceptions=True)

    async def batches(self, end: float) -> None:
        import openai

        sdk = openai.AsyncOpenAI(base_url=self.server.base_url + "/v1", api_key=self.keys["alpha"], max_retries=0,
                                 timeout=60, http_client=httpx.AsyncClient(trust_env=False, timeout=60))
        n = 0
        while not self.stop.is_set():
            await self.gate.wait()
            if self.stop.is_set():
                return
            n += 1
            self.batches_open += 1
            try:
                await one_batch(self.client, sdk, f"b{n}", BATCH_LINES, end + DRAIN_S)
            finally:
                self.batches_open -= 1
            await asyncio.sleep(1.0)

    async def faults_at(self, t0: float, plan: list[tuple[float, str]]) -> None:
        for at_s, sig in plan:  # one after another: a fault starts only once the last one recovered
            await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
            await self.gate.wait()  # not while a sample holds the traffic
            path, body = self.bodies[("completion", 0)]
            self.faults.append(await kill_engine(self.http, self.pgid, t0, self.keys["alpha"],
                                                 (path, body, self.client.refs[("completion", 0)]),
                                                 sig, HANG_TIMEOUT_S))

    async def run(self) -> list[str]:
        a = self.args
        self.http = httpx.AsyncClient(base_url=self.server.base_url, trust_env=False,
                                      timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10),
                                      limits=httpx.Limits(max_connections=4 * a.concurrency + 16))
        await self.reference()
        self.lag.start()
        duration = a.minutes * 60
        warm_s = min(WARMUP_S, WARMUP_FRACTION * duration)
        t0 = time.monotonic()
        end = t0 + duration
        await self.sample(t0)
        self.gate.set()
        tasks = [asyncio.ensure_future(self.worker(w)) for w in range(a.concurrency)]
        tasks += [asyncio.ensure_future(self.capped()), asyncio.ensure_future(self.batches(end))]
        extra = []
        if a.faults:
            self.plan = fault_plan(self.rng, duration, warm_s)
            extra.append(asyncio.ensure_future(self.faults_at(t0, self.plan)))
        while time.monotonic() < end:
            to_next = a.sample_s - (time.monotonic() - t0) % a.sample_s
            await asyncio.sleep(max(0.0, min(to_next, end - time.monotonic())))
            if time.monotonic() < end - 1:
                self.print_row(await self.sample(t0))
        self.stop.set()
        self.gate.set()
        done, pending = await asyncio.wait(tasks + extra, timeout=REQUEST_TIMEOUT_S + DRAIN_S + 10)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        self.print_row(await self.sample(t0))
        self.lag.stop()
        await self.http.aclose()
        outcomes = self.client.ledger.outcomes
        for o in outcomes:
            if o.status == "rate_limited" and o.tenant != "capped":
                o.status = "unexpected_429"  # only the capped tenant's limit is meant to trip
        settle(self.faults, outcomes)
        warm_index = next((i for i, s in enumerate(self.samples) if s["t_s"] >= warm_s), len(self.samples) - 1)
        why = report.verdict(self.samples, outcomes, self.faults, warm_index)
        if self.client.ledger.started != len(outcomes):
            why.append(f"{self.client.ledger.started} requests started, {len(outcomes)} recorded")
        if a.faults and len(self.faults) < 2:
            why.append(f"--faults, but {len(self.faults)} of the 2 faults were injected (the run is too short)")
        for f in self.faults:
            if f.get("probe_mismatch") and f.get("recovered_s") is None:
                why.append(f"after the engine's {f['signal']} the probe was answered wrongly: {f['probe_mismatch']}")
        self.warm_index = warm_index
        return why

    def print_row(self, s: dict) -> None:
        bad = {k: v for k, v in s["outcomes"].items() if k != "ok"}
        print(f"[{s['t_s'] / 60:5.1f} min] RSS {s['rss_mib']:.0f} MiB, fds {s['fds']}, threads {s['threads']}, "
              f"KV idle {s['kv_blocks_idle']}, ok {s['outcomes'].get('ok', 0)}, other {bad}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0,
                    help="traffic time (the reference run and the drain come on top)")
    ap.add_argument("--sample-s", type=float, default=None,
                    help="seconds between samples (default 60, an eighth of a run shorter than 8 minutes)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients besides the capped and batch ones")
    ap.add_argument("--max-tokens", type=int, default=24, help="of each checked request (json and tool: twice)")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts per request kind")
    ap.add_argument("--faults", action="store_true",
                    help="SIGKILL the engine process at a random time, later SIGSTOP it (a hang)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--server-args", default="", help="more `tokenmill serve` options")
    ap.add_argument("--json", type=Path, help="write the samples, outcomes and verdict here")
    ap.add_argument("--plot", type=Path, help="PNG of the samples (default: beside --json; needs matplotlib)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 minutes, 4 clients, short requests")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.concurrency, args.max_tokens, args.prompts = 3.0, 4, 8, 4
    if args.sample_s is None:
        args.sample_s = max(5.0, min(60.0, args.minutes * 60 / 8))
    work = Path(tempfile.mkdtemp(prefix="tokenmill-soak-"))
    keys = make_keys(work / "keys.db", args.concurrency)
    spec = ServerSpec(name="tokenmill", ready_path="/ready", cmd=serve_cmd(
        "--log-level", "warning", "--data-dir", str(work / "data"), "--keys-db", str(work / "keys.db"),
        "--kv-cache-gb", "0.25", "--shutdown-timeout", "5", "--capture", "all",
        "--engine-hang-timeout", str(HANG_TIMEOUT_S), *shlex.split(args.server_args)))
    t_start = time.monotonic()
    with RunningServer(spec, work) as server:
        soak = Soak(args, server, keys, work)
        why = asyncio.run(soak.run())
    outcomes = soak.client.ledger.outcomes
    print()
    print(report.table(soak.samples))
    print()
    print(report.summary(outcomes, soak.faults, why, args.minutes))
    print(f"wall {time.monotonic() - t_start:.0f} s; server log and data: {work}")
    if args.json:
        report.write_json(args.json, {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "thresholds": {k: getattr(report, k) for k in ("RSS_FLOOR_MIB", "RSS_MIB_PER_HOUR", "FDS_FLOOR",
                                                           "FDS_PER_HOUR", "FAULT_END_BOUND_S",
                                                           "FAULT_RECOVERY_BOUND_S")},
            "warm_index": soak.warm_index, "samples": soak.samples, "faults": soak.faults,
            "outcomes": dict(Counter(o.status for o in outcomes)),
            "kinds": {k: dict(Counter(o.status for o in outcomes if o.kind == k)) for k in {o.kind for o in outcomes}},
            "unexpected": [vars(o) | {"gaps": len(o.gaps)} for o in outcomes if o.status not in report.EXPECTED][:50],
            "requests": len(outcomes), "ok": not why, "why": why})
    plot = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if plot is not None and report.plot(plot, soak.samples, soak.faults):
        print(f"plot: {plot}")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
