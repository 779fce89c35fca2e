"""The race: tokenmill against its peers on one machine, the same model in several GGUF
formats, one workload, repeats interleaved.

Run it as `benchmarks/compare` (a wrapper that uses the repo's .venv; the same as
`python -m benchmarks.race.compare`). Peers (the default is tokenmill and llama-server;
`--only` adds the others):

- tokenmill: `.venv/bin/tokenmill serve`, default flags (`--quantization auto`: the file's blocks);
- llama.cpp's `llama-server` with `--parallel` slots, built from the llama.cpp that
  llama-cpp-python vendors into `.peers/llama-server` (cached; skipped with a note if it
  does not build); its version and system_info line are recorded with the table;
- llama-cpp-python[server], built into `.peers/llamacpp-venv` (cached);
- naive: transformers `generate()`, one request at a time, behind a minimal HTTP shim
  (benchmarks/race/naive_server.py), so it is measured over HTTP exactly like the others.

Formats: the embedded Q4_1, and Q4_0 and Q8_0 made from it with llama-quantize (llama.cpp's
x86 kernels are fastest on Q4_0; cached in `.peers/models`). Engine level, per format:
`llama-bench -p 512 -n 128` beside tokenmill's offline engine measured the same way
(benchmarks/engine/engine_speed.py). Server level: for each repeat, each format, each server is
started on its own loopback port, warmed up, driven by the tokenmill.bench harness at
concurrency 1, 4 and 16 (closed loop), then timed on 512-token prompts (TTFT), and stopped;
servers take turns going first. Every peer is pinned to the same number of threads. The
tables (medians over repeats; tokenmill / peer ratios) are printed and written, with the
exact command, into docs/benchmarks.md.

`--quick` is the smoke run the tests use: tokenmill alone (no peer is built or started
unless `--only` names it), the embedded Q4_1, one repeat, a tiny workload, and
docs/benchmarks.md left alone; it still prints the table.
"""

from __future__ import annotations

import argparse
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

from benchmarks.race.peers import (control_token_ids, ensure_peers, llama_bench, llama_cpp_version,
                                   model_files, system_info)
from benchmarks.race.table import (docs_block, engine_table, median_metrics, metrics_of, ratio_table, ttft_p50,
                                   write_docs)
from benchmarks.servers import ROOT, RunningServer, ServerSpec
from tokenmill.bench.client import ClientConfig
from tokenmill.bench.harness import BenchConfig, discover_model, run_benchmark
from tokenmill.bench.report import write_results
from tokenmill.bench.runner import RunSpec
from tokenmill.bench.stats import Slo
from tokenmill.bench.workload import LengthDist, WorkloadConfig

CONCURRENCY = (1, 4, 16)
ALL_PEERS = ("tokenmill", "llama-cpp-python", "llama-server", "naive")
DEFAULT_PEERS = ("tokenmill", "llama-server")
FORMATS = ("Q4_1", "Q4_0", "Q8_0")
# Other processes' average CPU use (in cores) above which a server's figures are flagged.
NOISY_CORES = 0.15


def engine_speed(gguf_file: Path, threads: int, quick: bool) -> dict[str, Any]:
    """benchmarks/engine/engine_speed.py on `gguf_file` (its own process: its memory and
    threads go with it)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engine.engine_speed", "--model", str(gguf_file),
                           "--threads", str(threads), *(["--quick"] if quick else [])],
                          capture_output=True, text=True, timeout=1800, check=True, cwd=ROOT)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tokenmill_spec(gguf_file: Path, threads: int, extra_args: list[str]) -> Optional[ServerSpec]:
    exe = [sys.executable, "-m", "tokenmill.cli"]
    try:
        # wide columns: rich would otherwise cut long flag names in the help table
        help_text = subprocess.run([*exe, "serve", "--help"], capture_output=True, text=True,
                                   timeout=60, env=dict(os.environ, COLUMNS="250")).stdout
    except (OSError, subprocess.TimeoutExpired):
        help_text = ""
    if "--port" not in help_text:
        return None
    cmd = [*exe, "serve", "--model", str(gguf_file), "--host", "127.0.0.1", "--port", "{port}"]
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
        "naive", [sys.executable, "-m", "benchmarks.race.naive_server",
                  "--model", str(gguf_file), "--port", "{port}", "--threads", str(threads)],
        "/ready", note=f"transformers generate(), fp32, torch threads {threads}, one request at a time, "
                       "over HTTP (benchmarks/race/naive_server.py)")


def workload(quick: bool, seed: int) -> tuple[WorkloadConfig, tuple[RunSpec, ...], float]:
    """The shared workload: (prompts, runs, per-run duration bound)."""
    if quick:
        w = WorkloadConfig(input_len=LengthDist(32), output_len=LengthDist(8), seed=seed)
        counts, duration = {1: 2, 4: 4, 16: 16}, 60.0
    else:
        w = WorkloadConfig(input_len=LengthDist(128), output_len=LengthDist(128), seed=seed)
        counts, duration = {1: 8, 4: 16, 16: 64}, 300.0
    runs = tuple(RunSpec("closed", counts[c], duration, concurrency=c) for c in CONCURRENCY)
    return w, runs, duration


# Time to first token on a long prompt, one request at a time: prefill speed as a client sees
# it. Fresh random prompts, so no request is served from a prefix cache.
TTFT_PROMPT = 512


def ttft_workload(quick: bool, seed: int) -> tuple[WorkloadConfig, tuple[RunSpec, ...]]:
    w = WorkloadConfig(input_len=LengthDist(TTFT_PROMPT), output_len=LengthDist(1), seed=seed + 7)
    return w, (RunSpec("closed", 2 if quick else 6, 120.0, concurrency=1),)


def bench_one(spec: ServerSpec, w: WorkloadConfig, runs: tuple[RunSpec, ...], out: Path,
              command: str, rep: int, quick: bool) -> dict[str, Any]:
    """Start `spec`, warm it up, run the workload (fresh prompts each repeat: a new seed,
    so no repeat is served from another's prefix cache) and the long-prompt TTFT runs,
    stop it; the results dict, with the TTFT runs under "ttft"."""
    with RunningServer(spec, out) as srv:
        print(f"[compare] {out.name} {spec.name} ready at {srv.base_url} after {srv.load_s:.1f} s; running "
              f"c={','.join(str(r.concurrency) for r in runs)} (repeat {rep})", file=sys.stderr, flush=True)
        model = discover_model(srv.base_url, None)
        client = ClientConfig(base_url=srv.base_url, model=model, ignore_eos=spec.ignore_eos,
                              extra_body=spec.extra_body, request_timeout_s=600.0)
        cfg = BenchConfig(client=client, workload=replace(w, seed=w.seed + 1000 * rep), runs=runs, slo=Slo(),
                          warmup=2, command=command)
        watch = srv.watch()
        results = run_benchmark(cfg)
        tw, truns = ttft_workload(quick, w.seed + 1000 * rep)
        ttft = run_benchmark(BenchConfig(client=client, workload=tw, runs=truns, slo=Slo(), warmup=0,
                                         command=command))
        other = watch.other_cores()
        results["meta"]["server"] = {"name": spec.name, "command": spec.cmd, "note": spec.note,
                                     "load_s": srv.load_s, "repeat": rep, "other_cpu_cores": other,
                                     "log": str(srv.log_path)}
        results["ttft"] = ttft["runs"]
        if other is not None and other > NOISY_CORES:
            print(f"[compare] warning: other processes kept {other:.2f} cores busy during "
                  f"{spec.name} (repeat {rep}); its figures are unreliable", file=sys.stderr, flush=True)
        write_results(results, out / spec.name / f"rep{rep}")
    return results


def machine_line(threads: int) -> str:
    """The CPU, its widest vector ISA and cores: "AMD EPYC" alone has named machines
    with and without AVX-512 here, and the kernels (ours and llama.cpp's) differ."""
    cpu, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown CPU":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = ("AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512 (no VNNI)" if "avx512f" in flags
           else "AVX2 (no AVX-512)" if "avx2" in flags else "no AVX2")
    return f"{cpu} ({isa}), {os.cpu_count()} cores, {platform.system()}; every server pinned to {threads} threads"


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks/compare", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tokenmill alone on Q4_1, one repeat, a tiny workload, docs left alone")
    ap.add_argument("--only", default=None, help=f"comma list of {', '.join(ALL_PEERS)} (default: "
                                                 f"{','.join(DEFAULT_PEERS)}; tokenmill with --quick)")
    ap.add_argument("--formats", default=None,
                    help=f"comma list of {', '.join(FORMATS)} (Q4_1 is the embedded file; default: all, "
                         "Q4_1 with --quick)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every server (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="per-server results, reports, plots and logs (default bench-results/compare, "
                         "bench-results/compare-quick with --quick)")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    ap.add_argument("--no-engine", action="store_true", help="skip llama-bench and the offline engine")
    ap.add_argument("--repeat", type=int, default=None,
                    help="run the workload N times per server and format, interleaved, and report each "
                         "metric's median (this VM shows occasional multi-second stalls; default 3, "
                         "1 with --quick)")
    ap.add_argument("--model", default=None,
                    help="race on this GGUF (a path or an installed model's name, e.g. qwen2.5-coder-0.5b) "
                         "instead of the embedded model's formats; prints its table and leaves "
                         "docs/benchmarks.md alone")
    ap.add_argument("--tokenmill-args", default="", help="extra flags for `tokenmill serve`, e.g. '--dtype bfloat16'")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel jobs for peer builds")
    args = ap.parse_args()
    command = shlex.join(["benchmarks/compare", *sys.argv[1:]])
    if args.only is None:
        args.only = "tokenmill" if args.quick else ",".join(DEFAULT_PEERS)
    if args.formats is None:
        args.formats = "Q4_1" if args.quick else ",".join(FORMATS)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    args.no_docs = args.no_docs or args.quick
    args.out = args.out or ROOT / "bench-results" / ("compare-quick" if args.quick else "compare")
    wanted = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(wanted) - set(ALL_PEERS)
    if unknown:
        sys.exit(f"unknown peers: {', '.join(sorted(unknown))}")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    model_file = None
    if args.model:
        from tokenmill.model.registry import resolve

        model_file = Path(resolve(args.model))
        if not model_file.is_file():
            sys.exit(f"no such model file: {model_file}")
        formats, args.no_docs = [model_file.name], True
    elif set(formats) - set(FORMATS):
        sys.exit(f"unknown formats: {', '.join(sorted(set(formats) - set(FORMATS)))}")

    w, runs, _ = workload(args.quick, args.seed)
    slot_ctx = max(2 * (w.input_len.mean + w.output_len.mean) + 64, TTFT_PROMPT + 64)
    skipped: dict[str, str] = {}
    peers = None
    if {"llama-cpp-python", "llama-server"} & set(wanted) or (model_file is None and set(formats) != {"Q4_1"}):
        peers = ensure_peers(ROOT / ".peers", jobs=args.jobs, want_server=True,
                             want_python="llama-cpp-python" in wanted)
    if model_file is not None:
        files, fmt_skipped = {model_file.name: model_file}, {}
    else:
        files, fmt_skipped = model_files(formats, peers.tool("llama-quantize") if peers else None,
                                         ROOT / ".peers" / "models")
    skipped.update({f"{fmt} file": why for fmt, why in fmt_skipped.items()})
    if not files:
        sys.exit("no model file to race on")
    tm_args = shlex.split(args.tokenmill_args)
    specs: dict[str, list[ServerSpec]] = {fmt: [] for fmt in files}
    for fmt, gguf_file in files.items():
        if "tokenmill" in wanted:
            tm = tokenmill_spec(gguf_file, args.threads, tm_args)
            if tm:
                specs[fmt].append(tm)
            else:
                skipped["tokenmill"] = "`tokenmill serve` does not exist yet"
        if "llama-cpp-python" in wanted and peers and peers.llamacpp_python:
            specs[fmt].append(llamacpp_python_spec(peers.llamacpp_python, gguf_file, args.threads,
                                                   ctx=4 * slot_ctx, banned=control_token_ids(gguf_file)))
        if "llama-server" in wanted:
            if peers and peers.llama_server:
                specs[fmt].append(llama_server_spec(peers.llama_server, gguf_file, args.threads, slot_ctx))
            else:
                skipped["llama-server"] = "did not build from the vendored source (see .peers/llama-server)"
        if "naive" in wanted:
            specs[fmt].append(naive_spec(gguf_file, args.threads))

    # Engine level first: it also prepares tokenmill's cached weights for each file, so no
    # server start below pays for that.
    engine: dict[str, dict[str, Any]] = {}
    if not args.no_engine:
        bench_bin = peers.tool("llama-bench") if peers else None
        for fmt, gguf_file in files.items():
            row: dict[str, Any] = {}
            print(f"[compare] engine level on {fmt}: tokenmill offline engine, llama-bench", file=sys.stderr, flush=True)
            try:
                row["tokenmill"] = engine_speed(gguf_file, args.threads, args.quick)
            except (subprocess.SubprocessError, ValueError) as exc:
                skipped[f"tokenmill engine on {fmt}"] = f"failed: {exc}"
            if bench_bin:
                try:
                    row["llama-bench"] = llama_bench(bench_bin, gguf_file, args.threads)
                except (subprocess.SubprocessError, ValueError, StopIteration) as exc:
                    skipped[f"llama-bench on {fmt}"] = f"failed: {exc}"
            engine[fmt] = row

    results: dict[str, dict[str, list[dict[str, Any]]]] = {fmt: {} for fmt in files}
    for rep in range(max(1, args.repeat)):
        for fmt, fmt_specs in specs.items():
            # servers take turns going first: neither always meets the machine fresh
            order = fmt_specs if rep % 2 == 0 else fmt_specs[::-1]
            for spec in order:
                if f"{spec.name} on {fmt}" in skipped:
                    continue
                try:
                    res = bench_one(spec, w, runs, args.out / fmt, command, rep, args.quick)
                    results[fmt].setdefault(spec.name, []).append(res)
                except (RuntimeError, OSError) as exc:
                    skipped[f"{spec.name} on {fmt}"] = f"failed: {exc}"
                    print(f"[compare] {spec.name}: {exc}", file=sys.stderr, flush=True)
    if not any(results.values()):
        sys.exit("no server could be measured")

    notes = {s.name: s.note for fmt_specs in specs.values() for s in fmt_specs if s.note}
    sections: list[tuple[str, str]] = []
    all_metrics: dict[str, dict[str, Any]] = {}
    per_rep: dict[str, dict[str, Any]] = {}
    first: Optional[dict[str, Any]] = None
    sysinfo = None
    for fmt, by_server in results.items():
        if not by_server:
            continue
        fmt_rep = {}
        for name, reps in by_server.items():
            first = first or reps[0]
            fmt_rep[name] = [dict(metrics_of(r), ttft512=ttft_p50(r)) for r in reps]
            busy = [o for r in reps if (o := r["meta"]["server"]["other_cpu_cores"]) is not None]
            if busy and max(busy) > NOISY_CORES:
                notes[f"{name} on {fmt}"] = (f"**noisy: other processes used up to {max(busy):.2f} cores "
                                             f"during its runs**")
            if name == "llama-server" and sysinfo is None:
                sysinfo = system_info(Path(reps[0]["meta"]["server"]["log"]))
        metrics = {name: median_metrics(r) for name, r in fmt_rep.items()}
        all_metrics[fmt], per_rep[fmt] = metrics, fmt_rep
        origin = ("the file given" if model_file is not None else "the embedded file" if fmt == "Q4_1"
                  else "made from the embedded Q4_1 by llama-quantize")
        quant = engine.get(fmt, {}).get("tokenmill", {}).get("quantization")
        sections.append((f"{fmt} ({origin}" + (f"; tokenmill runs it as {quant}" if quant else "") + ")",
                         ratio_table(metrics)))
    if engine:
        sections.insert(0, ("Engine level: llama-bench -p 512 -n 128 vs tokenmill's offline engine "
                            "(benchmarks/engine/engine_speed.py), same file, same threads", engine_table(engine)))
    if peers and peers.llama_server:
        notes["llama.cpp"] = llama_cpp_version(peers.llama_server) + (f"; system_info: {sysinfo}" if sysinfo else "")
    block = docs_block(sections, command=command, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       machine=machine_line(args.threads), workload=first["meta"] if first else {},
                       notes=notes, skipped=skipped, quick=args.quick, repeat=max(1, args.repeat))
    print(block)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(json.dumps({"command": command, "metrics": all_metrics, "engine": engine,
                                                      "per_repeat": per_rep, "notes": notes, "skipped": skipped},
                                                     indent=1))
    if not args.no_docs:
        write_docs(ROOT / "docs" / "benchmarks.md", block)
        print(f"[compare] wrote docs/benchmarks.md; per-server reports in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
