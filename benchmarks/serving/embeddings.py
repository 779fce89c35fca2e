"""Embeddings per second for 128-token inputs, at batch 1 and 32, over HTTP.

- tokenmill serving the embedded decoder (SmolLM2-135M, its default precision; last-token
  pooling) and the installed encoder (all-MiniLM-L6-v2, `tokenmill models install
  all-minilm-l6-v2`), each its own server;
- sentence-transformers on the encoder (in this process, no HTTP: its own `encode`, the
  ceiling a Python client gets), taking turns with each encoder server round by round, so
  a busy machine's swings hit both alike; and, where `python -m benchmarks.serving.st_onnx
  --install` has put ONNX Runtime in .peers/st-onnx, its pipeline with the transformer run
  by ONNX Runtime (its fastest CPU format; benchmarks/serving/st_onnx.py says why by hand),
  checked against `encode` (cosine >= 0.9999) before it is timed;
- llama-server `--embedding` on the same decoder GGUF, where benchmarks/race/peers.py has
  built it (`.peers/llama-server/bin/llama-server`; it is not built here).

Each input is text that tokenizes to exactly 128 tokens for the model that reads it.
Both engine modes by default: with the engine in a child process the 32 inputs of one body
reach it over a queue and may be split over several steps; in a thread they arrive as one
batch.
Batch 1: one input per request, requests one after another; batch 32: one request
holding 32 inputs. The rate is inputs embedded per second of wall time at the client,
the median over rounds.

    .venv/bin/python -m benchmarks.serving.embeddings [--rounds 3 --reps 3 --singles 16] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx

from benchmarks.servers import ROOT, RunningServer, ServerSpec, serve_cmd
from benchmarks.serving import st_onnx

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


def rates(embed, single: list[str], batch: list[str], reps: int) -> dict[str, list[float]]:
    """Per round, inputs per second at batch 1 (`single` one call each, one after another)
    and batch 32 (`batch` in one call, `reps` times: the median)."""
    t = time.perf_counter()
    for s in single:
        embed(s)
    one = len(single) / (time.perf_counter() - t)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        embed(batch)
        times.append(time.perf_counter() - t)
    return {"batch 1": [one], "batch 32": [len(batch) / statistics.median(times)]}


def measure(contenders: dict[str, object], single: list[str], batch: list[str], rounds: int,
            reps: int) -> dict[str, dict[str, float]]:
    """Each contender's rates, in rounds that take turns (a busy machine's swings hit
    them alike); the median over rounds."""
    got: dict[str, dict[str, list[float]]] = {k: {"batch 1": [], "batch 32": []} for k in contenders}
    for embed in contenders.values():  # warm
        embed(single[0])
        embed(batch)
    for _ in range(rounds):
        for name, embed in contenders.items():
            for k, v in rates(embed, single, batch, reps).items():
                got[name][k] += v
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in got.items()}


def http_embed(client: httpx.Client, model: str):
    def embed(inp) -> None:
        r = client.post("/v1/embeddings", json={"model": model, "input": inp})
        r.raise_for_status()
        assert len(r.json()["data"]) == (1 if isinstance(inp, str) else len(inp))
    return embed


def served_name(url: str) -> str:
    return httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="rounds taking turns (median over rounds)")
    ap.add_argument("--reps", type=int, default=3, help="batch-32 calls per round (median)")
    ap.add_argument("--singles", type=int, default=16, help="batch-1 calls per round")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096,
                    help="the servers' step budget (4096: a 32 x 128 batch in one step)")
    ap.add_argument("--engines", default="process,thread",
                    help="the servers' --engine modes to measure, comma-separated")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: one round of 4 single calls and one batch of 32, the process engine only")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.reps, args.singles, args.engines = 1, 1, 4, "process"
    import torch
    from sentence_transformers import SentenceTransformer

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
    st = SentenceTransformer(str(encoder), device="cpu")
    st_name = f"sentence-transformers (in-process, {torch.get_num_threads()} threads), all-MiniLM-L6-v2"

    def listed(inp) -> list[str]:
        return [inp] if isinstance(inp, str) else inp

    def st_embed(inp) -> None:
        st.encode(listed(inp), batch_size=32)

    peers = {st_name: st_embed}
    if st_onnx.available():
        ort_encode = st_onnx.encoder(st, str(encoder), ROOT / "bench-results" / "embeddings" / "onnx",
                                     torch.get_num_threads())
        sample = texts["encoder"][:32]
        cos = (ort_encode(sample) * st.encode(sample, batch_size=32)).sum(1).min()
        if cos < 0.9999:
            raise SystemExit(f"ONNX Runtime's vectors differ from sentence-transformers' (cosine {cos:.6f})")
        peers[f"sentence-transformers' pipeline on ONNX Runtime {st_onnx.PACKAGES[0].split('==')[1]} "
              f"(in-process, {torch.get_num_threads()} threads)"] = lambda inp: ort_encode(listed(inp))
    else:
        print(f"ONNX Runtime: not installed in {st_onnx.SITE} (python -m benchmarks.serving.st_onnx --install)")

    budget = ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    results: dict[str, dict[str, float]] = {}
    log_dir = ROOT / "bench-results" / "embeddings"
    for mode in args.engines.split(","):
        tail = "" if mode == "process" else f" (--engine {mode})"
        for kind, extra in (("decoder", ()), ("encoder", ("--model", "all-minilm-l6-v2"))):
            label = (f"tokenmill, SmolLM2-135M decoder (last token){tail}" if kind == "decoder"
                     else f"tokenmill, all-MiniLM-L6-v2 encoder{tail}")
            spec = ServerSpec("tokenmill-" + kind, serve_cmd(*budget, *extra, "--engine", mode), "/ready")
            with RunningServer(spec, log_dir) as srv, httpx.Client(base_url=srv.base_url, timeout=600,
                                                                    trust_env=False) as client:
                contenders = {label: http_embed(client, served_name(srv.base_url))}
                if kind == "encoder":  # taking turns with the server, in the same minutes
                    contenders.update({f"{name}, beside the {mode} engine": f for name, f in peers.items()})
                t = texts[kind]
                got = measure(contenders, t[32:], t[:32], args.rounds, args.reps)
            results.update(got)
            for name, r in got.items():
                print(name, {k: round(v, 1) for k, v in r.items()}, flush=True)
    peer = ROOT / ".peers" / "llama-server" / "bin" / "llama-server"
    if peer.exists():
        from benchmarks.race.peers import embedded_gguf

        spec = ServerSpec("llama-server", [str(peer), "-m", str(embedded_gguf()), "--port", "{port}", "--embedding",
                                           "--pooling", "last", "-b", "4096", "-ub", "4096", "-np", "1"], "/health")
        with RunningServer(spec, log_dir) as srv, httpx.Client(base_url=srv.base_url, timeout=600,
                                                                trust_env=False) as client:
            t = texts["decoder"]
            results.update(measure({"llama-server --embedding, SmolLM2-135M (last token)": http_embed(client, "x")},
                                   t[32:], t[:32], args.rounds, args.reps))
    else:
        print(f"llama-server: not built here ({peer} is missing; benchmarks/race/peers.py builds it)")
    print(f"\nembeddings/s, {TOKENS}-token inputs (server step budget {args.max_num_batched_tokens} tokens; "
          f"median of {args.rounds} rounds)\n")
    print("| | batch 1 | batch 32 |\n|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['batch 1']:.1f} | {r['batch 32']:.1f} |")


if __name__ == "__main__":
    main()
