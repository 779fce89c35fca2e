"""Top-p over a large vocabulary, on Qwen's 151,936 tokens: sorting every row whole, the
torch sampler's candidates path (tokenmill/engine/sampler.py `_apply_top_p`, what runs
without the native build), and the native draw that truncates inside (csrc/sampling.h
through `sample_rows`: what the engine's sampler and the decode bursts run), beside the
native draw without truncation.

    .venv/bin/python benchmarks/top_p_speed.py [--threads 2] [--repeat 20]

Two kinds of rows: LM-like (logits falling with the log of their rank, shuffled over the
vocabulary, a little noise: a nucleus of a few tokens) and flat (normal logits: a nucleus
of thousands of tokens, past the candidates, so the row is sorted whole). Prints the
median time per call at batch 1 and 16 (the torch columns truncate only; the native ones
truncate and draw), and how many tokens the full sort and the torch candidates path keep
differently (float32 sums over a nucleus of thousands of tokens round differently at its
edge; neither is more right).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tokenmill.engine.sampler import _apply_top_p  # noqa: E402
from tokenmill.model.kernels import native_ops  # noqa: E402

V = 151_936


def full_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus by sorting every row whole (the sampler's method before)."""
    sl, order = torch.sort(logits, dim=-1, descending=True)
    probs = sl.softmax(-1)
    drop = ((probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(1, order, sl.masked_fill(drop, float("-inf")))


def rows(kind: str, batch: int, g: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(batch, V, generator=g) * 3
    rank = torch.arange(1, V + 1).float()
    return torch.stack([(-3.25 * rank.log() + 0.3 * torch.randn(V, generator=g))[torch.randperm(V, generator=g)]
                        for _ in range(batch)])


def median_ms(f, x, p, repeat: int) -> float:
    f(x, p)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f(x, p)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"top_p {args.top_p}, vocabulary {V}, {args.threads} threads, median of {args.repeat}\n")
    ops = native_ops()
    print("| rows | batch | nucleus (tokens, first row) | full sort (ms) | torch candidates (ms) | native truncate + draw (ms) "
          "| native draw alone (ms) | kept differently (full sort vs candidates) |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("LM-like", "flat"):
        for batch in (1, 16):
            x = rows(kind, batch, g)
            p = torch.full((batch,), args.top_p)
            a, b = full_sort(x, p), _apply_top_p(x, p)
            differ = int((torch.isfinite(a) != torch.isfinite(b)).sum())
            t_full, t_cand = median_ms(full_sort, x, p, args.repeat), median_ms(_apply_top_p, x, p, args.repeat)
            native = alone = "n/a (no native build)"
            if ops is not None:
                temps, seeds, idx = torch.ones(batch), torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
                k0, m0 = torch.zeros(batch, dtype=torch.int64), torch.zeros(batch)
                native = f"{median_ms(lambda x, p: ops.sample_rows(x, temps, seeds, idx, k0, p, m0), x, p, args.repeat):.2f}"
                alone = f"{median_ms(lambda x, p: ops.sample_rows(x, temps, seeds, idx, k0, torch.ones(batch), m0), x, p, args.repeat):.2f}"
            print(f"| {kind} | {batch} | {int(torch.isfinite(b[0]).sum())} | {t_full:.2f} | {t_cand:.2f} | "
                  f"{native} | {alone} | {differ} |")

if __name__ == "__main__":
    main()
