"""Several models in one server (tokenmill/engine/models.py): what a model swap costs and
what a second resident model weighs.

- Swap: `tokenmill serve --model EMBEDDED --model PARTNER` under a memory budget that
  holds one of them. Each round asks the partner (the embedded model leaves memory),
  then the embedded model: the time to its first streamed token is the swap (unload the
  partner + start the embedded model's engine process + first token), with the page
  cache and the prepared-weights cache warm (a first round, not counted, warms them).
  Beside it: the engine start alone (the server's own `load_seconds`) and a warm
  request's TTFT.
- Memory: a second server with room for both and nothing unloading (--keep-alive -1):
  resident memory (RSS) of the server's process group and of each engine process with
  nothing loaded, each model alone, and both.

The partner: a Hugging Face folder of SmolLM2-135M-Instruct itself (the embedded GGUF
converted by transformers, served int4 as the GGUF is), so that both are the same size;
with --quick, a tiny random Llama over the same tokenizer; with --partner, an installed
model (`tokenmill models list`) or a model file or folder, served as `serve --model` would.

    .venv/bin/python -m benchmarks.serving.model_swap [--rounds 5] [--quick] [--partner qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.servers import RunningServer, ServerSpec, group_processes, serve_cmd
from tokenmill.model.embedded import default_model_path

MODEL = "SmolLM2-135M-Instruct"
KV_GB = 0.25
MiB = 1024 ** 2


def save_tokenizer(folder: str) -> None:
    from tokenmill.model.metadata import load_model_info

    tok = load_model_info(None).tokenizer
    tok.hf.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template.source, "eos_token": tok.hf.id_to_token(tok.eos_token_ids[0]),
                   "bos_token": tok.hf.id_to_token(tok.bos_token_id)}, f)


def make_partner(folder: str, quick: bool) -> None:
    import torch
    import transformers

    os.makedirs(folder, exist_ok=True)
    if quick:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                       tie_word_embeddings=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        d, f = os.path.split(default_model_path())
        src = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        # a model transformers read from a GGUF will not save itself: the same weights in a fresh one
        cfg = {k: v for k, v in src.config.to_dict().items() if k != "quantization_config"}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
        model.load_state_dict(src.state_dict())
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)


def ttft(url: str, model: str) -> float:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError(f"no token from {model}")


def states(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


def group_rss(pid: int) -> int:
    total = 0
    for entry, _ in group_processes(pid):
        try:
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def estimate(path: str) -> int:
    from tokenmill.engine.model_memory import weights_bytes

    return weights_bytes(path) + int(KV_GB * 1024 ** 3)


def swap(partner: str, name: str | None, rounds: int, logs: Path) -> dict[str, float]:
    sizes = sorted((estimate(default_model_path()), estimate(partner)))
    budget = (sizes[1] + sizes[0] / 2) / 1024 ** 3  # room for the larger, never for both
    spec = ServerSpec("swap", serve_cmd("--model", default_model_path(), "--model", partner, "--kv-cache-gb",
                                        str(KV_GB), "--memory-budget", f"{budget:.4f}", "--no-batch-api",
                                        "--log-level", "warning"), "/ready")
    swaps, loads, partner_swaps, warm = [], [], [], []
    with RunningServer(spec, logs) as srv:
        watch = srv.watch()
        name = name or next(m for m in states(srv.base_url) if m != MODEL)  # the name it is served under
        for r in range(rounds + 1):
            p = ttft(srv.base_url, name)  # the embedded model leaves memory
            s = ttft(srv.base_url, MODEL)  # and comes back: the swap
            w = ttft(srv.base_url, MODEL)
            row = states(srv.base_url)
            assert row[MODEL]["state"] == "loaded" and row[name]["state"] == "available", row
            if r:  # the first round warms the caches
                swaps.append(s)
                partner_swaps.append(p)
                warm.append(w)
                loads.append(row[MODEL]["load_seconds"])
        busy = watch.other_cores()
    med = statistics.median
    return {"other_cores": busy if busy is not None else float("nan"), "swap_s": med(swaps), "load_s": med(loads),
            "warm_ttft_s": med(warm), "partner_swap_s": med(partner_swaps), "partner_swap_max_s": max(partner_swaps),
            "swap_max_s": max(swaps), "name": name}


def memory(partner: str, name: str, logs: Path) -> dict[str, dict[str, float]]:
    spec = ServerSpec("memory", serve_cmd("--model", default_model_path(), "--model", partner, "--kv-cache-gb",
                                          str(KV_GB), "--keep-alive", "-1", "--no-batch-api", "--log-level",
                                          "warning"), "/ready")
    out = {}
    with RunningServer(spec, logs) as srv:
        url, pid = srv.base_url, srv.proc.pid

        def sample(label: str) -> None:
            time.sleep(1.0)  # the KV cache's pages are faulted in by a background thread
            row = states(url)
            out[label] = {"group_mib": group_rss(pid) / MiB,
                          **{m: (row[m]["memory"]["rss_bytes"] or 0) / MiB for m in (MODEL, name)}}

        sample("nothing loaded")
        for label, load, unload in ((f"{MODEL} alone", MODEL, None), (f"{name} alone", name, MODEL),
                                    ("both", MODEL, None)):
            if unload:
                httpx.post(f"{url}/v1/models/{unload}/unload", timeout=120).raise_for_status()
            httpx.post(f"{url}/v1/models/{load}/load", timeout=300).raise_for_status()
            ttft(url, load)
            sample(label)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny partner, 2 rounds")
    ap.add_argument("--partner", help="an installed model's name, or a model file or folder (default: a twin of "
                                      "the embedded model)")
    args = ap.parse_args()
    rounds = 2 if args.quick else args.rounds
    work = Path(tempfile.mkdtemp(prefix="tokenmill-swap-"))
    if args.partner:
        from tokenmill.model.registry import resolve

        partner, name = str(resolve(args.partner)), None
    else:
        name = "tiny-partner" if args.quick else "smollm2-twin"
        partner = str(work / name)
        make_partner(partner, args.quick)
    logs = work / "logs"
    s = swap(partner, name, rounds, logs)
    name = s["name"]
    print(f"swap, {MODEL} (default mode, warm caches), medians of {rounds} rounds; partner: {name}")
    print("| measure | seconds |\n|---|---|")
    print(f"| swap in: unload {name} + load + first token | {s['swap_s']:.2f} |")
    print(f"| of which the engine start (load_seconds) | {s['load_s']:.2f} |")
    print(f"| swap in {name} (unload {MODEL} + load + first token) | {s['partner_swap_s']:.2f} |")
    print(f"| slowest swap in of {name} | {s['partner_swap_max_s']:.2f} |")
    print(f"| first token, loaded | {s['warm_ttft_s']:.3f} |")
    print(f"| slowest swap in | {s['swap_max_s']:.2f} |")
    print(f"(other processes kept {s['other_cores']:.1f} of {os.cpu_count()} cores busy meanwhile)")
    m = memory(partner, name, logs)
    print(f"\nresident memory, MiB (KV cache {KV_GB} GiB each; group: the server and its engine processes)")
    print(f"| resident | group | {MODEL} engine | {name} engine |\n|---|---|---|---|")
    for label, row in m.items():
        print(f"| {label} | {row['group_mib']:.0f} | {row[MODEL]:.0f} | {row[name]:.0f} |")
    alone = m[f"{MODEL} alone"]["group_mib"] + m[f"{name} alone"]["group_mib"] - m["nothing loaded"]["group_mib"]
    print(f"\nboth resident: {m['both']['group_mib']:.0f} MiB against {alone:.0f} MiB for the two alone "
          f"(less the shared server process)")
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
