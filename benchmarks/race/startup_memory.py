"""Cold start and resident memory, tokenmill against llama-server on the same GGUF.

    python -m benchmarks.race.startup_memory [--rounds 3] [--tokens 32768] [--quick] [--model gemma3-270m]

Each round starts each server in turn (interleaved) and measures the seconds from the
command to its readiness path answering 200 (polled every 50 ms), then sends 16 requests
at once and reads the resident memory of the server's whole process group (the
tokenmill front process and its engine child; /proc/<pid>/status VmRSS, summed). Both
hold the same number of KV tokens: llama-server `--ctx-size N --parallel 16` (N cells
shared by 16 slots), tokenmill `--kv-cache-gb` sized to N tokens of its bf16 cache.
tokenmill's prepared-weights cache is warm (the first start of a round 0 warms it and is
reported apart). llama-server comes from `python -m benchmarks.race.peers --server-only`.
`--quick` (the tests' smoke run): tokenmill alone, one round, 2,048 KV tokens, 4 requests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import statistics
import subprocess
import time

import httpx

from benchmarks.servers import ROOT, free_port, group_processes, serve_cmd
from tokenmill.model.metadata import default_model_path, load_metadata

LLAMA_SERVER = ROOT / ".peers" / "llama-server" / "bin" / "llama-server"


def group_rss_mb(pgid: int) -> float:
    total = 0
    for entry, _ in group_processes(pgid):
        try:
            total += next((int(line.split()[1]) for line in (entry / "status").read_text().splitlines()
                           if line.startswith("VmRSS:")), 0)
        except (OSError, ValueError):
            continue  # gone meanwhile
    return total / 1024


def run_one(cmd: list[str], ready_path: str, requests: int = 16) -> tuple[float, float]:
    port = free_port()
    cmd = [c.format(port=port) for c in cmd]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
            try:
                if httpx.get(base + ready_path, timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"{cmd[0]} not ready in 300 s")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        model = httpx.get(base + "/v1/models", timeout=5, trust_env=False).json()["data"][0]["id"]
        # a completion, not chat: a base model (Gemma 3 270M) has no chat template
        body = {"model": model, "prompt": "Write a short story about a lighthouse.", "max_tokens": 64,
                "temperature": 0}

        def one(_):
            return httpx.post(base + "/v1/completions", json=body, timeout=120, trust_env=False).status_code

        with concurrent.futures.ThreadPoolExecutor(requests) as ex:
            codes = list(ex.map(one, range(requests)))
        if set(codes) != {200}:
            raise RuntimeError(f"{cmd[0]} answered {codes}")
        return ready, group_rss_mb(proc.pid)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32768, help="KV tokens both servers hold")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--quick", action="store_true", help="smoke run: tokenmill alone, one round, 2,048 KV "
                                                         "tokens, 4 requests")
    ap.add_argument("--model", default=None, help="an installed model's name or a GGUF file (default: the "
                                                  "embedded one)")
    args = ap.parse_args()
    requests = 4 if args.quick else 16
    if args.quick:
        args.rounds, args.tokens = 1, 2048
    if args.model is not None:
        from tokenmill.model.registry import resolve

        gguf = resolve(args.model)
    else:
        gguf = default_model_path()
    cfg, _ = load_metadata(gguf)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
    kv_gb = args.tokens * per_token / 1024 ** 3
    servers = {
        "tokenmill": (serve_cmd("--model", gguf, "--kv-cache-gb", f"{kv_gb:.4f}"), "/ready"),
    }
    if args.quick:
        print("(--quick: tokenmill alone)")
    elif LLAMA_SERVER.exists():
        servers["llama-server"] = ([str(LLAMA_SERVER), "-m", gguf, "--port", "{port}", "--threads",
                                    str(args.threads), "--ctx-size", str(args.tokens), "--parallel", "16"],
                                   "/health")
    else:
        print(f"(no llama-server at {LLAMA_SERVER}: python -m benchmarks.race.peers --server-only builds it)")
    first = run_one(*servers["tokenmill"], requests)  # warms the prepared-weights cache if cold
    results: dict[str, list[tuple[float, float]]] = {n: [] for n in servers}
    for _ in range(args.rounds):
        for name, (cmd, path) in servers.items():
            results[name].append(run_one(cmd, path, requests))
    print(f"{args.tokens} KV tokens each (tokenmill --kv-cache-gb {kv_gb:.3f}); medians of {args.rounds}; "
          f"tokenmill's first start this run: ready {first[0]:.2f} s")
    print(f"| server | ready (s) | resident after {requests} requests (MB) |\n|---|---|---|")
    med = {}
    for name, rs in results.items():
        med[name] = (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        print(f"| {name} | {med[name][0]:.2f} | {med[name][1]:.0f} |")
    if "llama-server" in med:
        a, b = med["tokenmill"], med["llama-server"]
        print(f"tokenmill / llama-server: ready {a[0] / b[0]:.2f}x, memory {a[1] / b[1]:.2f}x")


if __name__ == "__main__":
    main()
