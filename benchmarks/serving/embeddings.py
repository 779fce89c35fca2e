"""Embeddings per second for 128-token inputs, at batch 1 and 32, over HTTP.

- tokenmill serving the embedded decoder (SmolLM2-135M, its default precision; last-token
  pooling) and the installed encoder (all-MiniLM-L6-v2, `tokenmill models install
  all-minilm-l6-v2`), each its own server;
- sentence-transformers on the encoder (in this process, no HTTP: its own `encode`, the
  ceiling a Python client gets), run after the servers are stopped so nothing competes;
- llama-server `--embedding` on the same decoder GGUF, where benchmarks/race/peers.py has
  built it (`.peers/llama-server/bin/llama-server`; it is not built here).

Each input is text that tokenizes to exactly 128 tokens for the model that reads it.
Both engine modes by default: with the engine in a child process the 32 inputs of one body
reach it over a queue and may be split over several steps; in a thread they arrive as one
batch.
Batch 1: one input per request, requests one after another; batch 32: one request
holding 32 inputs. The rate is inputs embedded per second of wall time at the client.

    .venv/bin/python -m benchmarks.serving.embeddings [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx

from benchmarks.servers import ROOT, RunningServer, ServerSpec, serve_cmd

TOKENS = 128
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community "
         "name president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


def texts_of(tokenize, n: int, seed: int) -> list[str]:
    """n different texts that `tokenize` turns into exactly TOKENS ids (special tokens included)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        words: list[str] = []
        while len(tokenize(" ".join(words))) < TOKENS:
            words.append(rng.choice(WORDS))
        if len(tokenize(" ".join(words))) == TOKENS:
            out.append(" ".join(words))
    return out


def rates(url: str, model: str, single: list[str], batch: list[str], reps: int) -> dict[str, float]:
    """Inputs per second at batch 1 (requests one after another) and batch 32 (one request)."""
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as c:
        def post(inp) -> None:
            r = c.post("/v1/embeddings", json={"model": model, "input": inp})
            r.raise_for_status()
            assert len(r.json()["data"]) == (1 if isinstance(inp, str) else len(inp))

        post(single[0])  # warm
        post(batch)
        t = time.perf_counter()
        for s in single:
            post(s)
        one = len(single) / (time.perf_counter() - t)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            post(batch)
            times.append(time.perf_counter() - t)
        return {"batch 1": one, "batch 32": len(batch) / statistics.median(times)}


def served_name(url: str) -> str:
    return httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3, help="batch-32 requests per measurement (median)")
    ap.add_argument("--singles", type=int, default=32, help="batch-1 requests per measurement")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="the servers' step budget (4096: a 32 x 128 batch in one step)")
    ap.add_argument("--engines", default="process,thread",
                    help="the servers' --engine modes to measure, comma-separated")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 single requests, one batch of 32, the process engine only")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.singles, args.engines = 1, 4, "process"
    from tokenmill.model import registry
    from tokenmill.model.encoder_config import read_encoder_tokenizer
    from tokenmill.model.metadata import load_model_info

    encoder = registry.installed_path(registry.RECIPES["all-minilm-l6-v2"])
    if encoder is None:
        raise SystemExit("install the encoder first: tokenmill models install all-minilm-l6-v2")
    enc_tok = read_encoder_tokenizer(str(encoder))
    dec_tok = load_model_info(None).tokenizer
    texts = {"decoder": texts_of(dec_tok.encode, 32 + args.singles, 1),
             "encoder": texts_of(enc_tok.encode, 32 + args.singles, 2)}
    budget = ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    results: dict[str, dict[str, float]] = {}
    runs = [(label + ("" if mode == "process" else f" (--engine {mode})"), extra + ("--engine", mode))
            for mode in args.engines.split(",")
            for label, extra in (("tokenmill, SmolLM2-135M decoder (last token)", ()),
                                 ("tokenmill, all-MiniLM-L6-v2 encoder", ("--model", "all-minilm-l6-v2")))]
    for label, extra in runs:
        kind = "encoder" if "--model" in extra else "decoder"
        spec = ServerSpec("tokenmill-" + kind, serve_cmd(*budget, *extra), "/ready")
        with RunningServer(spec, ROOT / "bench-results" / "embeddings") as srv:
            t = texts[kind]
            results[label] = rates(srv.base_url, served_name(srv.base_url), t[32:], t[:32], args.reps)
        print(label, {k: round(v, 1) for k, v in results[label].items()}, flush=True)
    peer = ROOT / ".peers" / "llama-server" / "bin" / "llama-server"
    if peer.exists():
        from benchmarks.race.peers import embedded_gguf

        spec = ServerSpec("llama-server", [str(peer), "-m", str(embedded_gguf()), "--port", "{port}", "--embedding",
                                           "--pooling", "last", "-b", "4096", "-ub", "4096", "-np", "1"], "/health")
        with RunningServer(spec, ROOT / "bench-results" / "embeddings") as srv:
            t = texts["decoder"]
            results["llama-server --embedding, SmolLM2-135M (last token)"] = rates(srv.base_url, "x", t[32:], t[:32],
                                                                                 args.reps)
    else:
        print(f"llama-server: not built here ({peer} is missing; benchmarks/race/peers.py builds it)")
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(encoder), device="cpu")
    t = texts["encoder"]
    st.encode(t[:32], batch_size=32)  # warm
    start = time.perf_counter()
    for s in t[32:]:
        st.encode([s], batch_size=1)
    one = len(t[32:]) / (time.perf_counter() - start)
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        st.encode(t[:32], batch_size=32)
        times.append(time.perf_counter() - start)
    results[f"sentence-transformers (in-process, {torch.get_num_threads()} threads), all-MiniLM-L6-v2"] = {
        "batch 1": one, "batch 32": 32 / statistics.median(times)}
    print(f"\nembeddings/s, {TOKENS}-token inputs (server step budget {args.max_num_batched_tokens} tokens)\n")
    print("| | batch 1 | batch 32 |\n|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['batch 1']:.1f} | {r['batch 32']:.1f} |")


if __name__ == "__main__":
    main()
