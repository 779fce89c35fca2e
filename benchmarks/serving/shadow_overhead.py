"""What a shadow costs the client (serve --shadow, tokenmill/server/shadow.py).

One server, two resident models: the embedded SmolLM2-135M-Instruct and its twin (the
same weights as a Hugging Face folder, benchmarks/serving/model_swap.py), with
`--shadow SmolLM2-135M-Instruct=smollm2-twin:1` and `--model-alias plain=...`: requests
naming the model are mirrored to the twin, requests naming `plain` (the same model) are
not. Sequential greedy completions (32 tokens), in alternating blocks of three kinds:

- off: `plain`, no shadow;
- on, back to back: the model's name, each next request sent at once, so it runs beside
  the previous request's shadow (the CPU they share is the cost);
- on, gaps: the model's name, each next request sent once the previous shadow is done:
  only the ingress's own work (a copy of the body, an observer) is left.

Also the shadow's greedy match rate (the twin is served from other files of the same
weights: a difference shows the two loads' rounding apart).

    .venv/bin/python -m benchmarks.serving.shadow_overhead [--blocks 3] [--per-block 8] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.servers import RunningServer, ServerSpec, serve_cmd
from benchmarks.serving.model_swap import MODEL, make_partner
from tokenmill.model.embedded import default_model_path

BODY = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 32, "temperature": 0,
        "ignore_eos": True}


def shadow_done(url: str) -> int:
    s = httpx.get(url + "/v1/rollouts", timeout=30).json()["shadows"][0]
    return s["ok"] + s["error"] + s["dropped"] + s["skipped"]


def one(url: str, model: str) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={**BODY, "model": model}, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--per-block", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny twin, 1 block of 2, 8 tokens")
    args = ap.parse_args()
    blocks, per = (1, 2) if args.quick else (args.blocks, args.per_block)
    if args.quick:
        BODY["max_tokens"] = 8
    work = Path(tempfile.mkdtemp(prefix="tokenmill-shadow-"))
    name = "tiny-partner" if args.quick else "smollm2-twin"
    twin = str(work / name)
    make_partner(twin, args.quick)
    spec = ServerSpec("shadow", serve_cmd("--model", default_model_path(), "--model", twin, "--kv-cache-gb", "0.25",
                                          "--preload", "--no-batch-api", "--log-level", "warning",
                                          "--shadow", f"{MODEL}={name}:1", "--model-alias", f"plain={MODEL}"),
                      "/ready")
    times: dict[str, list[float]] = {"off": [], "on, back to back": [], "on, gaps": []}
    with RunningServer(spec, work / "logs") as srv:
        url = srv.base_url
        one(url, "plain")  # warm both
        one(url, MODEL)
        watch = srv.watch()
        for _ in range(blocks):
            for kind in times:
                for _ in range(per):
                    if kind == "on, gaps":
                        done = shadow_done(url)
                    times[kind].append(one(url, "plain" if kind == "off" else MODEL))
                    if kind == "on, gaps":
                        while shadow_done(url) <= done:
                            time.sleep(0.02)
                mirrored = 1 + len(times["on, back to back"]) + len(times["on, gaps"])
                while shadow_done(url) < mirrored:
                    time.sleep(0.05)  # no shadow left over into the next kind
        busy = watch.other_cores()
        shadow = httpx.get(url + "/v1/rollouts", timeout=30).json()["shadows"][0]
    print(f"client latency, {MODEL} (default mode), {BODY['max_tokens']} greedy tokens, sequential; "
          f"{blocks} blocks of {per} per kind")
    print("| kind | median s | p90 s | requests |\n|---|---|---|---|")
    for kind, v in times.items():
        v = sorted(v)
        print(f"| {kind} | {statistics.median(v):.3f} | {v[int(0.9 * (len(v) - 1))]:.3f} | {len(v)} |")
    lat = shadow["latency"]
    print(f"shadow: ok {shadow['ok']}, dropped {shadow['dropped']}, skipped {shadow['skipped']}, error "
          f"{shadow['error']}; greedy matches {shadow['matches']}/{shadow['compared']}; engine p50 primary "
          f"{lat['primary_p50_s']:.3f}s, shadow {lat['shadow_p50_s']:.3f}s")
    print(f"(other processes kept {busy if busy is not None else float('nan'):.1f} cores busy meanwhile)")


if __name__ == "__main__":
    main()
