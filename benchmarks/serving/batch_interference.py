"""What a large Batch API job costs live traffic, and what the batch gets done, in one run
against one server this script starts (the default mode unless --server-args says
otherwise; the Batch API's store in a fresh temporary --data-dir).

Phases, all over HTTP (the load generator is tokenmill.bench; the Batch API is driven
with the openai SDK):

1. idle capacity: a batch alone (no live traffic) -> its output tok/s, from
   usage.output_tokens over the time from "in_progress" to "completed" as seen by
   polling GET /v1/batches/{id} every --poll-s (finer than the server's whole-second
   in_progress_at/completed_at, which are in the JSON too);
2. live alone: a closed loop of --concurrency streaming chat clients, --live-requests
   requests of --live-tokens output tokens (greedy, ignore_eos), each request's TTFT
   and inter-chunk gaps (ITL) recorded;
3. live with batch: a large batch is submitted and followed until it is in progress
   and its lines are running, then the identical live load (fresh prompts of the same
   lengths) runs; the batch's own rate during that window is read from its
   usage.output_tokens (which grows as lines finish); then the batch is cancelled, so
   the next phase starts on an idle server.

Phases 2 and 3 are repeated --rounds times, interleaved ABBA (alone, with | with,
alone | ...) so drift on a shared machine falls on both. Percentiles pool the requests
of every round. The issue's aims: p99 TTFT with/alone <= 1.2 and ITL with/alone <= 1.1
(judged at p50 and p99). ITL is the bench's: gaps between content-bearing SSE chunks;
with decode bursts (--decode-steps, shared among the running sequences) a chunk can
carry several tokens alone and one beside a batch, so TPOT (a request's
(E2E - TTFT) / (tokens - 1), its per-token latency) is judged against the ITL aim too. "other cores" is
how many cores processes other than the server and this script kept busy (a shared
machine makes every figure here noisier; there, --server-args "--num-threads 1" keeps
torch's thread pool from spin-waiting on a core it does not get).

    .venv/bin/python -m benchmarks.serving.batch_interference [--quick] [--rounds 2] [--json out.json]
        [--server-args "--batch-share 0.2 --max-num-seqs 32"]

`--quick` (the tests' smoke run): one round, 2 live requests of 8 tokens, batches of 4 and
24 lines of 8-16 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.servers import CpuWatch, RunningServer, ServerSpec, serve_cmd
from tokenmill.bench.client import ClientConfig, RequestRecord
from tokenmill.bench.harness import discover_model
from tokenmill.bench.runner import RunSpec, run_once
from tokenmill.bench.stats import summarize
from tokenmill.bench.workload import LengthDist, WorkloadConfig, build_requests

FINAL = ("completed", "failed", "expired", "cancelled")
AIM_TTFT = 1.2
AIM_ITL = 1.1

# Batch prompts: every task x topic pair, plus the line's own tag, so no two lines (of
# one batch or of two batches) share a whole prompt.
TASKS = ("Write a short story about {}.", "Explain {} to a ten-year-old.", "List five facts about {}.",
         "Write a poem about {}.", "Describe a day in the life of {}.", "Give advice to someone interested in {}.")
TOPICS = ("a lighthouse keeper", "volcanoes", "the history of bread", "honeybees", "a city at night",
          "learning to swim", "the moon", "an old clock", "a mountain village", "rainforests",
          "a robot who paints", "the ocean tides")


def batch_lines(model: str, n: int, tag: str, min_tokens: int, max_tokens: int) -> list[dict[str, Any]]:
    pairs = [(t, p) for t in TASKS for p in TOPICS]
    span = max_tokens - min_tokens + 1
    out = []
    for i in range(n):
        task, topic = pairs[i % len(pairs)]
        out.append({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "temperature": 0, "ignore_eos": True,
                             "max_tokens": min_tokens + (i * 37) % span,
                             "messages": [{"role": "user", "content": f"{task.format(topic)} (#{tag}-{i})"}]}})
    return out


# -- the server ---------------------------------------------------------------------------
def server_spec(extra: list[str], work: Path) -> ServerSpec:
    """One `tokenmill serve`, with a fresh Batch API store unless --server-args says otherwise."""
    args = list(extra)
    for flag, value in (("--data-dir", str(work / "data")), ("--kv-cache-gb", "0.5"), ("--shutdown-timeout", "5")):
        if flag not in args:
            args += [flag, value]
    return ServerSpec(name="tokenmill", ready_path="/ready", cmd=serve_cmd("--log-level", "warning", *args))


def other_servers() -> list[str]:
    """Command lines of tokenmill servers already running (not ours: none is started yet)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "tokenmill.cli serve" in cmd or "tokenmill serve" in cmd:
                found.append(f"{entry.name}: {cmd.strip()[:160]}")
    return found


async def metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's unlabelled Prometheus samples (a scrape also resets the loop-lag max)."""
    out = {}
    for line in (await http.get(url + "/metrics")).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


# -- following a batch ----------------------------------------------------------------------
@dataclass
class Sample:
    t: float  # perf_counter seconds
    status: str
    completed: int
    failed: int
    output_tokens: int


@dataclass
class BatchWatch:
    """Polls one batch every `poll_s` in the background; `samples` grows as it goes."""

    client: Any  # openai.AsyncOpenAI
    batch_id: str
    poll_s: float
    samples: list[Sample] = field(default_factory=list)
    last: Any = None
    _task: asyncio.Task | None = None

    def start(self) -> BatchWatch:
        self._task = asyncio.ensure_future(self._poll())
        return self

    async def _poll(self) -> None:
        while True:
            b = await self.client.batches.retrieve(self.batch_id)
            rc, usage = b.request_counts, b.usage
            self.last = b
            self.samples.append(Sample(time.perf_counter(), b.status, rc.completed if rc else 0,
                                       rc.failed if rc else 0, usage.output_tokens if usage else 0))
            if b.status in FINAL:
                return
            await asyncio.sleep(self.poll_s)

    async def until(self, pred, timeout: float) -> Sample:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.samples and pred(self.samples[-1]):
                return self.samples[-1]
            if self._task is not None and self._task.done():
                self._task.result()  # raise what stopped the poller
                raise RuntimeError(f"batch {self.batch_id} ended {self.samples[-1].status} while waiting")
            await asyncio.sleep(self.poll_s / 4)
        raise TimeoutError(f"batch {self.batch_id}: condition not met in {timeout:.0f} s "
                           f"(last: {self.samples[-1] if self.samples else None})")

    async def done(self, timeout: float) -> None:
        assert self._task is not None
        await asyncio.wait_for(asyncio.shield(self._task), timeout)

    def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def first(self, status: tuple[str, ...]) -> float | None:
        return next((s.t for s in self.samples if s.status in status), None)


async def submit(client, lines: list[dict[str, Any]]) -> str:
    data = b"".join(json.dumps(x, separators=(",", ":")).encode() + b"\n" for x in lines)
    f = await client.files.create(file=("in.jsonl", data), purpose="batch")
    b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    return b.id


def window_rate(samples: list[Sample], t0: float, t1: float) -> dict[str, Any]:
    """The batch's output tok/s over [t0, t1] from the polls. usage.output_tokens grows
    only when a line finishes, so the plain difference over the window is quantized by
    lines; when the count rose at least 3 times inside the window, the rate between its
    first and last rise is used (the tokens that finished after the first rise, over the
    time between them), else the plain difference over the window."""
    inside = [s for s in samples if t0 <= s.t <= t1]
    before = [s for s in samples if s.t < t0]
    base = before[-1] if before else (inside[0] if inside else None)
    if base is None or not inside:
        return {"tok_s": None, "tokens": 0, "lines": 0, "rises": 0, "method": "no samples"}
    rises, prev = [], base
    for s in inside:
        if s.output_tokens > prev.output_tokens:
            rises.append(s)
        prev = s
    tokens = inside[-1].output_tokens - base.output_tokens
    lines = inside[-1].completed + inside[-1].failed - base.completed - base.failed
    plain = tokens / (t1 - t0) if t1 > t0 else None
    if len(rises) >= 3 and rises[-1].t > rises[0].t:
        rate = (rises[-1].output_tokens - rises[0].output_tokens) / (rises[-1].t - rises[0].t)
        method = "between first and last rise"
    else:
        rate, method = plain, "difference over the window"
    return {"tok_s": rate, "tok_s_plain": plain, "tokens": tokens, "lines": lines, "rises": len(rises),
            "method": method}


# -- the phases -------------------------------------------------------------------------------
@dataclass
class Bench:
    args: argparse.Namespace
    server: RunningServer
    model: str
    client: Any  # openai.AsyncOpenAI
    http: httpx.AsyncClient
    pgid: int
    phase_no: int = 0

    def live_cfg(self) -> ClientConfig:
        return ClientConfig(base_url=self.server.base_url, model=self.model, endpoint="chat", temperature=0.0,
                            ignore_eos=True, request_timeout_s=900)

    async def settle(self, timeout: float = 120.0) -> None:
        """Wait until the engine has nothing running or waiting (a cancelled batch's lines
        are being aborted, the previous phase's last requests are ending)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            m = await metrics(self.http, self.server.base_url)
            if m.get("tokenmill_num_requests_running", 0) == 0 and m.get("tokenmill_num_requests_waiting", 0) == 0:
                return
            await asyncio.sleep(0.25)
        raise TimeoutError("the server did not go idle")

    async def live(self, label: str) -> tuple[list[RequestRecord], float, dict[str, Any]]:
        """One live-load run; returns its records, duration and what the server said."""
        a = self.args
        self.phase_no += 1
        wl = WorkloadConfig(input_len=LengthDist(a.live_input), output_len=LengthDist(a.live_tokens), seed=a.seed)
        requests = build_requests(wl, a.live_requests, run_index=self.phase_no)
        spec = RunSpec(mode="closed", num_requests=a.live_requests, duration_s=a.live_duration,
                       concurrency=a.concurrency)
        m0 = await metrics(self.http, self.server.base_url)  # resets the loop-lag max
        watch = CpuWatch(self.pgid)
        outcome = await run_once(self.live_cfg(), spec, requests, seed=a.seed)
        other = watch.other_cores()
        m1 = await metrics(self.http, self.server.base_url)
        extra = {"other_cores": other,
                 "loop_lag_max_s": m1.get("tokenmill_event_loop_lag_max_seconds"),
                 "preemptions": m1.get("tokenmill_preemptions", 0) - m0.get("tokenmill_preemptions", 0)}
        bad = [r for r in outcome.records if not r.ok]
        if bad:
            print(f"  {label}: {len(bad)} live requests failed, e.g. {bad[0].error_kind}: {bad[0].error}",
                  flush=True)
        return outcome.records, outcome.duration_s, extra

    async def idle_capacity(self) -> dict[str, Any]:
        a = self.args
        await self.settle()
        m0 = await metrics(self.http, self.server.base_url)
        lines = batch_lines(self.model, a.idle_lines, "idle", a.batch_min_tokens, a.batch_max_tokens)
        bid = await submit(self.client, lines)
        t_sub = time.perf_counter()
        watch = CpuWatch(self.pgid)
        w = BatchWatch(self.client, bid, a.poll_s).start()
        try:
            await w.done(a.batch_timeout)
        finally:
            w.stop()
        other = watch.other_cores()
        m1 = await metrics(self.http, self.server.base_url)
        b = w.last
        if b.status != "completed":
            raise RuntimeError(f"the idle-capacity batch ended {b.status}: {b.errors}")
        t_in = w.first(("in_progress", "finalizing", "completed"))
        t_done = w.first(("completed",))
        t_fin = w.first(("finalizing", "completed"))
        out_tokens = b.usage.output_tokens
        res = {"batch_id": bid, "lines": b.request_counts.total, "completed": b.request_counts.completed,
               "failed": b.request_counts.failed, "output_tokens": out_tokens,
               # (a batch may finish within one poll: then the server's stamps give the rate)
               "polled_s": t_done - t_in, "tok_s": out_tokens / (t_done - t_in) if t_done > t_in else None,
               "tok_s_to_finalizing": out_tokens / (t_fin - t_in) if t_fin and t_fin > t_in else None,
               "server_s": (b.completed_at - b.in_progress_at) if b.completed_at and b.in_progress_at else None,
               "validating_s": t_in - t_sub, "other_cores": other,
               "preemptions": m1.get("tokenmill_preemptions", 0) - m0.get("tokenmill_preemptions", 0)}
        res["server_tok_s"] = out_tokens / res["server_s"] if res["server_s"] else None
        # A quick batch may finish within one poll and within the server's one-second stamps; then the
        # rate falls back to the stamps, and last to submit-to-done (validation included, so a floor).
        res["tok_s_method"] = "polled"
        if res["tok_s"] is None and res["server_tok_s"] is not None:
            res["tok_s"], res["tok_s_method"] = res["server_tok_s"], "server stamps"
        if res["tok_s"] is None:
            res["tok_s"], res["tok_s_method"] = out_tokens / max(t_done - t_sub, 1e-6), "submit to done"
        return res

    async def with_batch(self, label: str) -> tuple[list[RequestRecord], float, dict[str, Any]]:
        a = self.args
        await self.settle()
        bid = await submit(self.client, batch_lines(self.model, a.load_lines, f"load{self.phase_no + 1}",
                                                    a.batch_min_tokens, a.batch_max_tokens))
        t_sub = time.perf_counter()
        w = BatchWatch(self.client, bid, a.poll_s).start()
        try:
            await w.until(lambda s: s.status == "in_progress", a.batch_timeout)
            validating_s = w.samples[-1].t - t_sub
            # its lines handed to the engine and running (and a first step done)
            deadline = time.perf_counter() + 60
            while time.perf_counter() < deadline:
                m = await metrics(self.http, self.server.base_url)
                if m.get("tokenmill_num_requests_running", 0) >= min(a.load_lines, 8):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(a.batch_lead_s)
            t0 = time.perf_counter()
            records, dur, extra = await self.live(label)
            t1 = time.perf_counter()
            await asyncio.sleep(a.poll_s * 1.5)  # one more poll that sees the window's end
            rate = window_rate(w.samples, t0, t1)
            last = w.samples[-1]
            rate["covered"] = last.status == "in_progress" and last.completed + last.failed < a.load_lines
            rate["batch_id"] = bid
            rate["validating_s"] = validating_s  # submit (uploaded, created) to seen in_progress
            extra["batch"] = rate
            if not rate["covered"]:
                print(f"  {label}: the batch ended before the live load did: raise --load-lines", flush=True)
            if last.status not in FINAL:
                t_cancel = time.perf_counter()
                await self.client.batches.cancel(bid)
                await w.done(a.batch_timeout)
                rate["cancel_s"] = w.samples[-1].t - t_cancel  # cancel to seen cancelled
            return records, dur, extra
        finally:
            w.stop()


# -- figures --------------------------------------------------------------------------------
def live_figures(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tpot = [d for d in ((r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) for r in ok
                        if r.output_tokens > 1 and r.ttft_ms is not None and r.e2e_ms is not None)]
    out_tok = sum(r.output_tokens for r in ok)
    return {"requests": len(records), "ok": len(ok), "duration_s": duration_s,
            "output_tokens": out_tok, "live_tok_s": out_tok / duration_s if duration_s > 0 else None,
            "chunks_per_request": statistics.mean(r.num_chunks for r in ok) if ok else None,
            "ttft_ms": summarize([r.ttft_ms for r in ok if r.ttft_ms is not None]),
            "itl_ms": summarize([g for r in ok for g in r.itl_ms]),
            "tpot_ms": summarize(tpot)}


def ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report(res: dict[str, Any]) -> None:
    alone, withb, idle = res["pooled"]["alone"], res["pooled"]["with_batch"], res["idle_capacity"]
    print(f"\n{res['rounds']} rounds, ABBA; c={res['config']['concurrency']}, {res['config']['live_requests']} "
          f"requests x {res['config']['live_tokens']} tokens a phase; percentiles pool every round\n")
    print("| live traffic | alone | with batch | with/alone | aim |")
    print("|---|---|---|---|---|")
    aims = {("ttft_ms", "p99"): AIM_TTFT, ("itl_ms", "p50"): AIM_ITL, ("itl_ms", "p99"): AIM_ITL,
            ("tpot_ms", "p50"): AIM_ITL, ("tpot_ms", "p99"): AIM_ITL}
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL (chunk gaps)"), ("tpot_ms", "TPOT (per token)")):
        for p in ("p50", "p99"):
            a, b = alone[key][p], withb[key][p]
            aim = aims.get((key, p))
            r = ratio(a, b)
            aim_s = "-" if aim is None else f"<= {aim}: {'met' if r is not None and r <= aim else 'NOT met'}"
            print(f"| {name} {p}, ms | {fmt(a)} | {fmt(b)} | {fmt(r, '.2f')} | {aim_s} |")
    print(f"| live output tok/s | {fmt(alone['live_tok_s'])} | {fmt(withb['live_tok_s'])} | "
          f"{fmt(ratio(alone['live_tok_s'], withb['live_tok_s']), '.2f')} | - |")
    print(f"| SSE chunks per request | {fmt(alone['chunks_per_request'])} | {fmt(withb['chunks_per_request'])} "
          f"| - | - |")
    under = res["batch_under_live"]
    share = ratio(idle["tok_s"], under["tok_s_median"])
    print("\n| batch | output tok/s | note |")
    print("|---|---|---|")
    print(f"| alone (idle capacity) | {fmt(idle['tok_s'])} | {idle['lines']} lines, {idle['output_tokens']} tokens "
          f"in {idle['polled_s']:.1f} s (server stamps: {fmt(idle['server_tok_s'])} tok/s over "
          f"{fmt(idle['server_s'], '.0f')} s) |")
    print(f"| under the live load | {fmt(under['tok_s_median'])} | median of rounds "
          f"{', '.join(fmt(x) for x in under['tok_s_rounds'])}; {fmt(100 * share if share else None, '.0f')}% of "
          f"idle capacity |")
    live_plus = (withb["live_tok_s"] or 0) + (under["tok_s_median"] or 0)
    print(f"| live + batch, with batch | {live_plus:.1f} | server output under both; "
          f"{fmt(100 * live_plus / idle['tok_s'], '.0f')}% of idle capacity |")
    print("\nper phase:")
    for ph in res["phases"]:
        f, x = ph["live"], ph["extra"]
        line = (f"  round {ph['round']} {ph['kind']:10s} TTFT p50/p99 {fmt(f['ttft_ms']['p50'])}/"
                f"{fmt(f['ttft_ms']['p99'])} ms, ITL p50/p99 {fmt(f['itl_ms']['p50'])}/{fmt(f['itl_ms']['p99'])} ms, "
                f"TPOT p50 {fmt(f['tpot_ms']['p50'])} ms, live {fmt(f['live_tok_s'])} tok/s, "
                f"{f['ok']}/{f['requests']} ok in {f['duration_s']:.1f} s, other cores {fmt(x['other_cores'], '.2f')}, "
                f"loop lag max {fmt(1000 * x['loop_lag_max_s'] if x['loop_lag_max_s'] is not None else None)} ms")
        if "batch" in x:
            b = x["batch"]
            line += (f"; batch {fmt(b['tok_s'])} tok/s ({b['lines']} lines, {b['tokens']} tokens done in the "
                     f"window, {b['method']}{'' if b['covered'] else ', NOT covering the window'}), "
                     f"{x['preemptions']:.0f} preemptions, batch validated in {b['validating_s']:.2f} s, "
                     f"cancelled in {fmt(b.get('cancel_s'), '.2f')} s")
        print(line)
    print(f"  idle capacity: other cores {fmt(idle['other_cores'], '.2f')}, {idle['preemptions']:.0f} preemptions, "
          f"validated in {idle['validating_s']:.2f} s")
    m = res["aims"]

    def met(key: str) -> str:
        return "met" if m[key] else "NOT met"

    print(f"\naims: p99 TTFT ratio {fmt(m['ttft_p99_ratio'], '.2f')} <= {AIM_TTFT}: {met('ttft_p99_met')}; "
          f"ITL (chunk gaps) ratio p50 {fmt(m['itl_p50_ratio'], '.2f')}, p99 {fmt(m['itl_p99_ratio'], '.2f')} "
          f"<= {AIM_ITL}: p50 {met('itl_p50_met')}, p99 {met('itl_p99_met')}; per token (TPOT) ratio p50 "
          f"{fmt(m['tpot_p50_ratio'], '.2f')}, p99 {fmt(m['tpot_p99_ratio'], '.2f')}: p50 {met('tpot_p50_met')}, "
          f"p99 {met('tpot_p99_met')}")
    ca, cb = alone["chunks_per_request"], withb["chunks_per_request"]
    if ca and cb and abs(cb / ca - 1) > 0.1:
        print(f"note: a live answer came in {ca:.1f} SSE chunks alone and {cb:.1f} beside the batch (decode "
              "bursts are shared among the running sequences), so chunk gaps are not comparable: judge ITL by TPOT")


async def run(args: argparse.Namespace, server: RunningServer) -> dict[str, Any]:
    import openai

    model = discover_model(server.base_url, None)
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    async with client, httpx.AsyncClient(timeout=30, trust_env=False) as http:
        bench = Bench(args, server, model, client, http, pgid=server.proc.pid)
        # warm-up: a small batch and a few live requests (lazy set-up is no part of a phase)
        bid = await submit(client, batch_lines(model, 4, "warm", 8, 8))
        w = BatchWatch(client, bid, args.poll_s).start()
        await w.done(args.batch_timeout)
        if w.last.status != "completed":
            raise RuntimeError(f"the warm-up batch ended {w.last.status}: {w.last.errors}")
        wl = WorkloadConfig(input_len=LengthDist(args.live_input), output_len=LengthDist(8), seed=args.seed)
        n = 2 * args.concurrency
        await run_once(bench.live_cfg(), RunSpec(mode="closed", num_requests=n, concurrency=args.concurrency),
                       build_requests(wl, n, -1))

        print("idle capacity (the batch alone) ...", flush=True)
        idle = await bench.idle_capacity()
        print(f"  {idle['output_tokens']} tokens in {idle['polled_s']:.1f} s: {fmt(idle['tok_s'])} tok/s "
              f"({idle['tok_s_method']}; other cores {fmt(idle['other_cores'], '.2f')})", flush=True)
        if (idle["other_cores"] or 0) > 0.5 and "--num-threads" not in args.server_args:
            print("  warning: other processes keep a core busy; torch's thread pool (one thread a core) can "
                  "slow down many times over on a shared machine: consider --server-args \"--num-threads 1\"",
                  flush=True)

        phases: list[dict[str, Any]] = []
        pooled: dict[str, list[RequestRecord]] = {"alone": [], "with_batch": []}
        durations: dict[str, float] = {"alone": 0.0, "with_batch": 0.0}
        for rnd in range(1, args.rounds + 1):
            order = ("alone", "with_batch") if rnd % 2 else ("with_batch", "alone")
            for kind in order:
                label = f"round {rnd} {kind}"
                print(f"{label} ...", flush=True)
                if kind == "alone":
                    await bench.settle()
                    # the same polling as beside a batch (of the finished idle batch), so
                    # both phases carry the same monitoring load
                    poller = asyncio.ensure_future(_poll_forever(client, idle["batch_id"], args.poll_s))
                    try:
                        records, dur, extra = await bench.live(label)
                    finally:
                        poller.cancel()
                        await asyncio.gather(poller, return_exceptions=True)
                else:
                    records, dur, extra = await bench.with_batch(label)
                f = live_figures(records, dur)
                pooled[kind] += records
                durations[kind] += dur
                phases.append({"round": rnd, "kind": kind, "live": f, "extra": extra})
                print(f"  TTFT p50/p99 {fmt(f['ttft_ms']['p50'])}/{fmt(f['ttft_ms']['p99'])} ms, ITL p50/p99 "
                      f"{fmt(f['itl_ms']['p50'])}/{fmt(f['itl_ms']['p99'])} ms, live {fmt(f['live_tok_s'])} tok/s"
                      + (f", batch {fmt(extra['batch']['tok_s'])} tok/s" if "batch" in extra else ""), flush=True)

    alone = live_figures(pooled["alone"], durations["alone"])
    withb = live_figures(pooled["with_batch"], durations["with_batch"])
    rates = [p["extra"]["batch"]["tok_s"] for p in phases if p["kind"] == "with_batch"]
    known = [r for r in rates if r is not None]
    aims = {"ttft_p99_ratio": ratio(alone["ttft_ms"]["p99"], withb["ttft_ms"]["p99"]),
            "itl_p50_ratio": ratio(alone["itl_ms"]["p50"], withb["itl_ms"]["p50"]),
            "itl_p99_ratio": ratio(alone["itl_ms"]["p99"], withb["itl_ms"]["p99"]),
            "tpot_p50_ratio": ratio(alone["tpot_ms"]["p50"], withb["tpot_ms"]["p50"]),
            "tpot_p99_ratio": ratio(alone["tpot_ms"]["p99"], withb["tpot_ms"]["p99"])}
    aims["ttft_p99_met"] = aims["ttft_p99_ratio"] is not None and aims["ttft_p99_ratio"] <= AIM_TTFT
    aims["itl_p50_met"] = aims["itl_p50_ratio"] is not None and aims["itl_p50_ratio"] <= AIM_ITL
    aims["itl_p99_met"] = aims["itl_p99_ratio"] is not None and aims["itl_p99_ratio"] <= AIM_ITL
    aims["tpot_p50_met"] = aims["tpot_p50_ratio"] is not None and aims["tpot_p50_ratio"] <= AIM_ITL
    aims["tpot_p99_met"] = aims["tpot_p99_ratio"] is not None and aims["tpot_p99_ratio"] <= AIM_ITL
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "server_cmd": server.spec.cmd,
            "model": model, "rounds": args.rounds, "idle_capacity": idle, "phases": phases,
            "pooled": {"alone": alone, "with_batch": withb},
            "batch_under_live": {"tok_s_rounds": rates, "tok_s_median": statistics.median(known) if known else None},
            "aims": aims}


async def _poll_forever(client, batch_id: str, poll_s: float) -> None:
    while True:
        await client.batches.retrieve(batch_id)
        await asyncio.sleep(poll_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, tiny live load and batches")
    ap.add_argument("--rounds", type=int, default=2, help="alone/with-batch pairs, interleaved ABBA")
    ap.add_argument("--concurrency", type=int, default=2, help="live streaming clients (closed loop)")
    ap.add_argument("--live-requests", type=int, default=None, help="live requests a phase (default 48; quick 2)")
    ap.add_argument("--live-tokens", type=int, default=64, help="output tokens of each live request")
    ap.add_argument("--live-input", type=int, default=64, help="prompt length of each live request (words ~ tokens)")
    ap.add_argument("--live-duration", type=float, default=None, help="also stop starting live requests after this")
    ap.add_argument("--idle-lines", type=int, default=None, help="lines of the idle-capacity batch (default 128; "
                                                                 "quick 4)")
    ap.add_argument("--load-lines", type=int, default=None, help="lines of each batch run beside live traffic "
                                                                 "(default 2048; quick 24); cancelled when the "
                                                                 "live load ends")
    ap.add_argument("--batch-min-tokens", type=int, default=64)
    ap.add_argument("--batch-max-tokens", type=int, default=128)
    ap.add_argument("--batch-lead-s", type=float, default=1.0, help="batch running alone before live traffic starts")
    ap.add_argument("--poll-s", type=float, default=0.25, help="GET /v1/batches/{id} interval")
    ap.add_argument("--batch-timeout", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra `tokenmill serve` flags, one string")
    ap.add_argument("--keep", action="store_true", help="keep the server log and data dir")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.live_requests is None:
        args.live_requests = 2 if args.quick else 48
    if args.idle_lines is None:
        args.idle_lines = 4 if args.quick else 128
    if args.load_lines is None:
        args.load_lines = 24 if args.quick else 2048
    if args.quick:
        args.rounds, args.live_tokens, args.live_input = 1, 8, 16
        args.batch_min_tokens, args.batch_max_tokens, args.batch_lead_s, args.poll_s = 8, 16, 0.2, 0.1

    others = other_servers()
    if others:
        print("warning: other tokenmill servers are running (they share the CPU):\n  " + "\n  ".join(others),
              file=sys.stderr)
    # SIGTERM/SIGHUP stop the run like Ctrl-C does, so the server is always stopped
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    work = Path(tempfile.mkdtemp(prefix="batch-interference-"))
    spec = server_spec(shlex.split(args.server_args), work)
    ok = False
    try:
        print(f"starting: {shlex.join(spec.cmd)}", flush=True)
        with RunningServer(spec, work) as server:
            res = asyncio.run(run(args, server))
        report(res)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1, default=str))
            print(f"\nwrote {args.json}")
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"server log and data: {work}", file=sys.stderr)

if __name__ == "__main__":
    main()
