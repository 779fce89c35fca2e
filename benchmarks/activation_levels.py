"""What the second int8 level of the activations costs and buys: the int4 matmul's speed
with one level and with two, at 1, 16 and 512 rows, and greedy fidelity of the default
mode with one level everywhere instead of two, beside llama-server's, on one GGUF.

    .venv/bin/python benchmarks/activation_levels.py [--gguf FILE] [--no-llama-server]
                                                     [--no-fidelity] [--no-engine] [--threads 2]

Two levels (the rounding residual quantized again) double the integer dot products of
every int4 layer. At one row the step is memory-bound and that is free; from a few rows
on it is what the matmul's time is made of, so this is the price of the default's
fidelity in prefill and in batched decode. The one-level run is an ablation made here
(the loader's int4 layers built with `precise=False`; the output projection keeps its
two levels, as it always does), not a mode the server offers. The engine part runs the
offline engine both ways, rounds interleaved: 16 requests of 128 prompt and 128 output
tokens at once (the race's C=16 without HTTP) and a 512-token prefill (its TTFT).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import fidelity  # noqa: E402
from tokenmill.model import loader  # noqa: E402
from tokenmill.model.kernels import native_ops  # noqa: E402
from tokenmill.model.quant import Int4Linear, quant_vnni_available  # noqa: E402

SHAPES = ((3072, 576), (576, 1536), (960, 576))  # SmolLM2's gate_up, down, qkv (out, in)


def matmul_speed(repeat: int = 15) -> None:
    ops = native_ops()
    print("\n| out x in | rows | two levels GMAC/s | one level GMAC/s | one / two |\n|---|---|---|---|---|")
    for n, k in SHAPES:
        tiles = Int4Linear(torch.randn(n, k) * 0.05, precise=True).tiles
        for m in (1, 16, 512):
            x = torch.randn(m, k).to(torch.bfloat16)
            rates = []
            for precise in (True, False):
                ops.q4_gemv(x, tiles, False, precise)
                times = []
                for _ in range(repeat):
                    t = time.perf_counter()
                    ops.q4_gemv(x, tiles, False, precise)
                    times.append(time.perf_counter() - t)
                rates.append(m * n * k / statistics.median(times) / 1e9)
            print(f"| {n} x {k} | {m} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[1] / rates[0]:.2f}x |", flush=True)


@contextmanager
def one_level_loads():
    """Inside: the loader builds int4 layers with one activation level, and caches nothing
    (not beside the real default's entry)."""
    real = loader.quantize_linear

    def without_second_level(kind, weight, bias, precise=False, grid=None):
        return real(kind, weight, bias, False, grid)

    loader.quantize_linear = without_second_level
    saved = os.environ.get("TOKENMILL_PREPARED_DIR")
    os.environ["TOKENMILL_PREPARED_DIR"] = "off"
    try:
        yield
    finally:
        loader.quantize_linear = real
        if saved is None:
            del os.environ["TOKENMILL_PREPARED_DIR"]
        else:
            os.environ["TOKENMILL_PREPARED_DIR"] = saved


def one_level(gguf: str, ids: list[list[int]], max_tokens: int) -> fidelity.Answers:
    with one_level_loads():
        answers = fidelity.run_mode("default", gguf, ids, max_tokens)
    return fidelity.Answers("default, one int8 level", answers.texts, answers.seconds)


def engine_speed(gguf: str, rounds: int = 2) -> None:
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.api import SamplingParams
    from tokenmill.engine.llm import LLM

    def engine():
        return LLM(loader.load_model(gguf, "bfloat16", "auto"),
                   config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.5, enable_prefix_caching=False)))

    two = engine()
    with one_level_loads():
        one = engine()
    vocab = two.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    def batch(llm) -> float:
        t = time.perf_counter()
        llm.generate([ids(128) for _ in range(16)], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
        return 16 * 128 / (time.perf_counter() - t)

    def prefill(llm) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            llm.generate([ids(512)], SamplingParams(max_tokens=1, temperature=0))
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    for llm in (two, one):  # warm-up
        batch(llm)
    rows = {"two": ([], []), "one": ([], [])}
    for _ in range(rounds):
        for name, llm in (("two", two), ("one", one)):
            rows[name][0].append(batch(llm))
            rows[name][1].append(prefill(llm))
    print(f"\noffline engine, {Path(gguf).name}, {rounds} interleaved rounds (medians)")
    print("| activations | 16 x (128 + 128) output tok/s | 512-token prefill ms |\n|---|---|---|")
    for name in ("two", "one"):
        print(f"| {name} int8 level{'s' if name == 'two' else ''} | {statistics.median(rows[name][0]):.0f} | "
              f"{statistics.median(rows[name][1]):.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--no-fidelity", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not quant_vnni_available():
        sys.exit("the int8-activation kernels are not built on this machine (tokenmill doctor)")
    gguf = args.gguf or loader.default_model_path()
    matmul_speed()
    if not args.no_engine:
        engine_speed(gguf)
    if args.no_fidelity:
        return
    ids = fidelity.prompt_ids(gguf)
    runs = [fidelity.run_mode("exact", gguf, ids, args.max_tokens),
            fidelity.run_mode("default", gguf, ids, args.max_tokens),
            one_level(gguf, ids, args.max_tokens)]
    if not args.no_llama_server and fidelity.LLAMA_SERVER.exists():
        runs.append(fidelity.run_llama_server(fidelity.LLAMA_SERVER, gguf, ids, args.max_tokens, args.threads))
    print(f"\n{len(ids)} prompts, greedy, {args.max_tokens} tokens, {Path(gguf).name}")
    print("| Run | exact matches | mean agreed prefix |\n|---|---|---|")
    for r in runs:
        same, share = r.score(runs[0])
        print(f"| {r.name} | {same}/{len(ids)} | {100 * share:.0f}% |")


if __name__ == "__main__":
    main()
