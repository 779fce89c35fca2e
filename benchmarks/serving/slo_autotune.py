"""Operating costs and gains, in one run against servers this script starts one at a time:

1. **Goodput under a step load**: open-loop Poisson arrivals, light, then heavy (past
   what the server can serve within the objectives), then light again. Goodput is
   requests per second that met both objectives as the client saw them: TTFT (send to
   first streamed token) and TPOT ((end - first token) / (tokens - 1)), each under its
   objective; a refused request (503) meets nothing. The same arrival schedule (same
   seed) is played against:
   - the default static configuration (`tokenmill serve` as shipped);
   - a sweep of static configurations (max running sequences x admission queue bound);
   - the autotuner (`serve --slo-ttft-ms X --slo-itl-ms Y`), starting from the defaults.
   The issue's bar: the autotuner within 10% of the best static setting found.
2. **Tracing overhead**: single-stream decode tok/s and TTFT with and without
   `--otlp-traces-endpoint` (spans exported to a collector in this script), servers
   alternated ABAB over --rounds.

    .venv/bin/python -m benchmarks.serving.slo_autotune [--quick] [--only goodput|tracing] [--json out.json]

Check that nothing else runs first: on two cores one stray process skews every figure.
`--quick` (the tests' smoke run): phases of 1-2 s, 32 + 8 tokens, one static setting
beside the default and the autotuner, one tracing round of 2 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from benchmarks.servers import RunningServer, ServerSpec, serve_cmd
from tokenmill.bench.client import ClientConfig, RequestRecord, send_request
from tokenmill.bench.runner import make_client, preconnect
from tokenmill.bench.workload import LengthDist, WorkloadConfig, synthetic_requests

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float  # requests/s
    seconds: float


def server_spec(name: str, args: list[str]) -> ServerSpec:
    return ServerSpec(name=name, ready_path="/ready",
                      cmd=serve_cmd("--log-level", "info", "--shutdown-timeout", "5", *args))


def schedule(phases: list[Phase], seed: int) -> list[tuple[float, int]]:
    """(send time, phase index) for every request: Poisson within each phase."""
    rng = random.Random(f"step-{seed}")
    out, start = [], 0.0
    for i, p in enumerate(phases):
        t = start + rng.expovariate(p.rate)
        while t < start + p.seconds:
            out.append((t, i))
            t += rng.expovariate(p.rate)
        start += p.seconds
    return out


async def play(base_url: str, arrivals: list[tuple[float, int]], workload: WorkloadConfig) -> list[RequestRecord]:
    cfg = ClientConfig(base_url=base_url, model=MODEL, request_timeout_s=300.0)
    specs = synthetic_requests(workload, len(arrivals))
    async with make_client(cfg, 256) as client:
        await preconnect(client, cfg, 32)
        t0 = time.perf_counter()

        async def one(at: float, spec) -> RequestRecord:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await send_request(client, cfg, spec, t0)

        return list(await asyncio.gather(*(one(at, s) for (at, _), s in zip(arrivals, specs))))


def tpot_ms(r: RequestRecord) -> float | None:
    if r.ttft_ms is None or r.e2e_ms is None or r.output_tokens < 2:
        return None
    return (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1)


def meets(r: RequestRecord, ttft_ms: float, itl_ms: float) -> bool:
    t = tpot_ms(r)
    return r.ok and r.ttft_ms is not None and r.ttft_ms <= ttft_ms and (t is None or t <= itl_ms)


def summarize(records: list[RequestRecord], arrivals: list[tuple[float, int]], phases: list[Phase],
              ttft_ms: float, itl_ms: float) -> dict[str, Any]:
    total_s = sum(p.seconds for p in phases)
    out: dict[str, Any] = {"requests": len(records), "ok": sum(r.ok for r in records),
                           "refused": sum((r.error_kind or "") == "http_503" for r in records),
                           "met": sum(meets(r, ttft_ms, itl_ms) for r in records)}
    out["goodput_rps"] = out["met"] / total_s
    ok_ttft = sorted(r.ttft_ms for r in records if r.ok and r.ttft_ms is not None)
    out["ttft_p50_ms"] = statistics.median(ok_ttft) if ok_ttft else None
    out["phases"] = []
    for i, p in enumerate(phases):
        mine = [r for r, (_, k) in zip(records, arrivals) if k == i]
        tp = [t for t in (tpot_ms(r) for r in mine if r.ok) if t is not None]
        out["phases"].append({"phase": p.name, "sent": len(mine), "met": sum(meets(r, ttft_ms, itl_ms) for r in mine),
                              "refused": sum((r.error_kind or "") == "http_503" for r in mine),
                              "goodput_rps": sum(meets(r, ttft_ms, itl_ms) for r in mine) / p.seconds,
                              "tpot_p50_ms": statistics.median(tp) if tp else None})
    return out


def autotune_changes(base_url: str) -> list[dict[str, Any]]:
    try:
        return httpx.get(base_url + "/v1/stats", timeout=10, trust_env=False).json().get("autotune", {}).get(
            "changes", [])
    except httpx.HTTPError:
        return []


def goodput(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    phases = [Phase("light", args.light_rate, args.light_s), Phase("heavy", args.heavy_rate, args.heavy_s),
              Phase("light again", args.light_rate, args.light_s)]
    arrivals = schedule(phases, args.seed)
    workload = WorkloadConfig(input_len=LengthDist(args.input_tokens), output_len=LengthDist(args.output_tokens),
                              seed=args.seed)
    slo = ["--slo-ttft-ms", str(args.ttft_ms), "--slo-itl-ms", str(args.itl_ms)]
    configs: list[tuple[str, list[str]]] = [("default (static)", [])]
    for seqs in args.sweep_seqs:
        for waiting in args.sweep_waiting:
            configs.append((f"static seqs={seqs} waiting={waiting}",
                            ["--max-num-seqs", str(seqs), "--max-waiting", str(waiting)]))
    configs.append(("autotuner", slo + ["--autotune-interval", str(args.autotune_interval)]))
    print(f"step load: {', '.join(f'{p.name} {p.rate:g}/s for {p.seconds:g} s' for p in phases)}; "
          f"{len(arrivals)} requests of {args.input_tokens} prompt / {args.output_tokens} output tokens; "
          f"objectives TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.itl_ms:g} ms", flush=True)
    rows = []
    for name, extra in configs:
        spec = server_spec("tokenmill", ["--num-threads", str(args.threads), *extra])
        with RunningServer(spec, work / name.replace(" ", "_")) as server:
            # a short warm-up, off the clock
            asyncio.run(play(server.base_url, [(0.0, 0), (0.0, 0)], WorkloadConfig(seed=args.seed + 99)))
            records = asyncio.run(play(server.base_url, arrivals, workload))
            row = {"config": name, "args": extra, **summarize(records, arrivals, phases, args.ttft_ms, args.itl_ms)}
            if name == "autotuner":
                row["changes"] = autotune_changes(server.base_url)
        rows.append(row)
        print(f"  {name:34s} goodput {row['goodput_rps']:.2f} req/s  met {row['met']}/{row['requests']}  "
              f"refused {row['refused']}  per phase " +
              " / ".join(f"{ph['goodput_rps']:.2f}" for ph in row["phases"]), flush=True)
    statics = [r for r in rows if r["config"].startswith("static")]
    best = max(statics, key=lambda r: r["goodput_rps"]) if statics else None
    return {"phases": [vars(p) for p in phases], "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.itl_ms},
            "workload": {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "seed": args.seed},
            "rows": rows, "best_static": best["config"] if best else None}


class _Collector(BaseHTTPRequestHandler):
    spans_bytes = 0

    def do_POST(self):  # noqa: N802 (the http.server API)
        n = int(self.headers.get("content-length", "0"))
        type(self).spans_bytes += len(self.rfile.read(n))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


async def single_stream(base_url: str, n: int, max_tokens: int, seed: int) -> tuple[float, float]:
    cfg = ClientConfig(base_url=base_url, model=MODEL)
    specs = synthetic_requests(WorkloadConfig(input_len=LengthDist(64), output_len=LengthDist(max_tokens),
                                              seed=seed), n)
    async with make_client(cfg, 2) as client:
        await preconnect(client, cfg, 1)
        recs = [await send_request(client, cfg, s, time.perf_counter()) for s in specs]
    rates = [r.decode_tokens_per_s for r in recs if r.decode_tokens_per_s]
    ttfts = [r.ttft_ms for r in recs if r.ok and r.ttft_ms is not None]
    if len(rates) != n:
        raise RuntimeError(f"{n - len(rates)} of {n} requests failed: {[r.error for r in recs if not r.ok][:3]}")
    return statistics.median(rates), statistics.median(ttfts)


def tracing(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_port}/v1/traces"
    arms = {"off": [], "on": ["--otlp-traces-endpoint", endpoint]}
    got: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    try:
        for rnd in range(args.rounds):
            for arm in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                spec = server_spec(f"tracing-{arm}", ["--num-threads", str(args.threads), *arms[arm]])
                with RunningServer(spec, work / f"tracing-{arm}-{rnd}") as server:
                    asyncio.run(single_stream(server.base_url, 2, 16, 1000 + rnd))  # warm-up, not counted
                    rate, ttft = asyncio.run(single_stream(server.base_url, args.stream_requests,
                                                           args.stream_tokens, rnd))
                got[arm].append((rate, ttft))
                print(f"  round {rnd} tracing {arm:3s}: decode {rate:.1f} tok/s, TTFT p50 {ttft:.1f} ms", flush=True)
    finally:
        collector.shutdown()
    off = statistics.median(r for r, _ in got["off"])
    on = statistics.median(r for r, _ in got["on"])
    return {"rounds": args.rounds, "requests_per_round": args.stream_requests,
            "decode_tok_s": {"off": off, "on": on}, "ratio_on_off": on / off,
            "ttft_p50_ms": {"off": statistics.median(t for _, t in got["off"]),
                            "on": statistics.median(t for _, t in got["on"])},
            "otlp_bytes_received": _Collector.spans_bytes}


def report(res: dict[str, Any]) -> None:
    if "goodput" in res:
        g = res["goodput"]
        print("\n| configuration | goodput req/s | met / sent | refused (503) | " +
              " | ".join(f"{p['name']} goodput" for p in g["phases"]) + " |")
        print("|---|---|---|---|" + "---|" * len(g["phases"]))
        for r in g["rows"]:
            mark = " (best static)" if r["config"] == g["best_static"] else ""
            print(f"| {r['config']}{mark} | {r['goodput_rps']:.2f} | {r['met']} / {r['requests']} | {r['refused']} | " +
                  " | ".join(f"{p['goodput_rps']:.2f}" for p in r["phases"]) + " |")
        rows = {r["config"]: r for r in g["rows"]}
        tuned, default = rows["autotuner"]["goodput_rps"], rows["default (static)"]["goodput_rps"]
        if g["best_static"]:
            best = rows[g["best_static"]]["goodput_rps"]
            print(f"\nautotuner / best static: {tuned / best:.2f}x (bar: >= 0.90); "
                  f"autotuner / default: {tuned / default:.2f}x" if best and default else "")
        for c in rows["autotuner"].get("changes", []):
            print(f"  autotune: {c['knob']} {c['old']} -> {c['new']} ({c['reason']})")
    if "tracing" in res:
        t = res["tracing"]
        print(f"\ntracing: single-stream decode {t['decode_tok_s']['on']:.1f} tok/s on vs "
              f"{t['decode_tok_s']['off']:.1f} off ({t['ratio_on_off']:.3f}x; aim >= 0.99); TTFT p50 "
              f"{t['ttft_p50_ms']['on']:.1f} vs {t['ttft_p50_ms']['off']:.1f} ms; "
              f"{t['otlp_bytes_received']} bytes of spans received")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("goodput", "tracing"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 1-2 s phases, one static setting, one tracing round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--itl-ms", type=float, default=40.0, help="the TPOT objective")
    ap.add_argument("--light-rate", type=float, default=1.5)
    ap.add_argument("--heavy-rate", type=float, default=9.0)
    ap.add_argument("--light-s", type=float, default=30.0)
    ap.add_argument("--heavy-s", type=float, default=60.0)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--sweep-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 64])
    ap.add_argument("--sweep-waiting", type=lambda s: [int(x) for x in s.split(",")], default=[4, 16, 256])
    ap.add_argument("--autotune-interval", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4, help="tracing: servers alternated this many times each")
    ap.add_argument("--stream-requests", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=128, help="tracing: output tokens a request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.light_s, args.heavy_s, args.light_rate, args.heavy_rate = 1.0, 2.0, 1.0, 3.0
        args.input_tokens, args.output_tokens, args.autotune_interval = 32, 8, 1.0
        args.sweep_seqs, args.sweep_waiting = [8], [16]
        args.rounds, args.stream_requests, args.stream_tokens = 1, 2, 16
    work = Path(tempfile.mkdtemp(prefix="slo-autotune-"))
    res: dict[str, Any] = {"time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:]}
    if args.only in (None, "goodput"):
        res["goodput"] = goodput(args, work)
    if args.only in (None, "tracing"):
        res["tracing"] = tracing(args, work)
    report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
        print(f"\nwrote {args.json}")
    print(f"server logs: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
