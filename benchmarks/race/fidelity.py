"""Fidelity: greedy chat answers of every precision mode, and of llama-server on the same
GGUF, against the exact mode (float32, no quantization: logits equal transformers').

    python -m benchmarks.race.fidelity [--modes exact,default,int8,bfloat16] [--max-tokens 32]
                                       [--llama-server PATH | --no-llama-server] [--gguf FILE]
                                       [--prompts N] [--quick]

The prompts are benchmarks/data/fidelity_prompts.jsonl (64 chat prompts written for this),
rendered with the model's chat template once, so every engine reads the same text (a base
model without a chat template, such as Gemma 3 270M: as `Question: ...` / `Answer:` text to
complete). For each mode it prints the exact-match rate (answers whose text equals the
exact mode's) and the mean agreed prefix (the share of the exact answer's characters
before the first difference). llama-server gets the ids through /completion with
temperature 0 (its greedy path); it is built by `python -m benchmarks.race.peers
--server-only`. `--quick` (the tests' smoke run): exact and default on 4 prompts, 8
tokens, no llama-server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.servers import ROOT, free_port
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.model.loader import default_model_path, load_metadata, load_model

PROMPTS = ROOT / "benchmarks" / "data" / "fidelity_prompts.jsonl"
LLAMA_SERVER = ROOT / ".peers" / "llama-server" / "bin" / "llama-server"

# name -> (dtype, quantization, kv_cache_dtype); "default" is what `tokenmill serve` runs
MODES = {
    "exact": ("float32", "none", "auto"),
    "bfloat16": ("bfloat16", "none", "auto"),
    "default": ("bfloat16", "auto", "auto"),  # the file's blocks: int4 for 4-bit files, int8 for Q8_0
    "int4": ("bfloat16", "int4", "auto"),  # 4 bits everywhere, the file's 5-8-bit blocks rounded
    "int8": ("bfloat16", "int8", "auto"),
    "default+kv8": ("bfloat16", "auto", "int8"),
}


@dataclass
class Answers:
    name: str
    texts: list[str]
    seconds: float

    def score(self, ref: "Answers") -> tuple[int, float]:
        """(answers equal to ref's, mean share of ref's characters before the first difference)."""
        same, shares = 0, []
        for a, b in zip(self.texts, ref.texts):
            same += a == b
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            shares.append(1.0 if not b else n / len(b))
        return same, sum(shares) / len(shares)


def prompt_ids(gguf: str) -> list[str]:
    _, tok = load_metadata(gguf)
    assert tok is not None
    with open(PROMPTS, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if tok.chat_template is None:  # a base model: the question as text to complete
        return [f"Question: {r['messages'][-1]['content']}\nAnswer:" for r in rows]
    return [tok.apply_chat_template(r["messages"]) for r in rows]


def run_mode(name: str, gguf: str, ids: list[str], max_tokens: int) -> Answers:
    dtype, quant, kv = MODES[name]
    t0 = time.perf_counter()
    llm = LLM(load_model(gguf, dtype, quant),
              config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.5, kv_cache_dtype=kv)))
    res = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    texts = [r.outputs[0].text for r in res]
    return Answers(name, texts, time.perf_counter() - t0)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def run_llama_server(binary: Path, gguf: str, ids: list[str], max_tokens: int, threads: int) -> Answers:
    port = free_port()
    cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
           "--threads-batch", str(threads), "--ctx-size", "4096", "--parallel", "1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.2)
        texts = []
        for p in ids:
            out = _post(f"http://127.0.0.1:{port}/completion",
                        {"prompt": p, "n_predict": max_tokens, "temperature": 0.0, "cache_prompt": False})
            texts.append(out["content"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return Answers(f"llama-server ({Path(gguf).name})", texts, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="exact,bfloat16,default,int8,default+kv8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER))
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--show", type=int, default=0, help="print the first N answers of every run")
    ap.add_argument("--json", default=None, help="write the answers and scores here")
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--quick", action="store_true", help="smoke run: exact and default, 4 prompts, 8 tokens, "
                                                         "no llama-server")
    args = ap.parse_args()
    if args.quick:
        args.modes, args.max_tokens, args.no_llama_server = "exact,default", 8, True
        args.prompts = args.prompts or 4
    gguf = args.gguf or default_model_path()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if "exact" not in modes:
        modes.insert(0, "exact")
    modes.remove("exact")
    modes.insert(0, "exact")
    ids = prompt_ids(gguf)[:args.prompts]
    print(f"{len(ids)} prompts, greedy, {args.max_tokens} tokens, model {Path(gguf).name}", flush=True)
    runs = []
    for m in modes:
        runs.append(run_mode(m, gguf, ids, args.max_tokens))
        print(f"  ran {m} ({runs[-1].seconds:.0f} s)", file=sys.stderr, flush=True)
    binary = Path(args.llama_server)
    if not args.no_llama_server:
        if binary.exists():
            runs.append(run_llama_server(binary, gguf, ids, args.max_tokens, args.threads))
        else:
            print(f"  (no llama-server at {binary}: build it with python -m benchmarks.race.peers --server-only)",
                  file=sys.stderr)
    ref = runs[0]
    print("\n| Run | exact matches | mean agreed prefix |\n|---|---|---|")
    scores = {}
    for r in runs:
        same, share = r.score(ref)
        scores[r.name] = {"exact_matches": same, "prompts": len(ids), "agreed_prefix": share}
        print(f"| {r.name} | {same}/{len(ids)} | {100 * share:.0f}% |")
    for r in runs:
        for i in range(min(args.show, len(ids))):
            print(f"[{r.name} #{i}] {r.texts[i]!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scores": scores, "answers": {r.name: r.texts for r in runs}}, f, indent=1)


if __name__ == "__main__":
    main()
