"""Top-p over a large vocabulary: the sampler's candidates path (tokenmill/engine/sampler.py
`_apply_top_p`) against sorting every row whole, on Qwen's 151,936 tokens.

    .venv/bin/python benchmarks/top_p_speed.py [--threads 2] [--repeat 20]

Two kinds of rows: LM-like (logits falling with the log of their rank, shuffled over the
vocabulary, a little noise: a nucleus of a few tokens) and flat (normal logits: a nucleus
of thousands of tokens, past the candidates, so the row is sorted whole). Prints the
median time per call at batch 1 and 16, and how many tokens one kept and the other did
not (float32 sums over a nucleus of thousands of tokens round differently at its edge;
neither is more right).
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
    print("| rows | batch | nucleus (tokens, first row) | full sort (ms) | candidates (ms) | speed-up | tokens kept by one, not the other |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("LM-like", "flat"):
        for batch in (1, 16):
            x = rows(kind, batch, g)
            p = torch.full((batch,), args.top_p)
            a, b = full_sort(x, p), _apply_top_p(x, p)
            differ = int((torch.isfinite(a) != torch.isfinite(b)).sum())
            t_full, t_cand = median_ms(full_sort, x, p, args.repeat), median_ms(_apply_top_p, x, p, args.repeat)
            print(f"| {kind} | {batch} | {int(torch.isfinite(b[0]).sum())} | {t_full:.2f} | {t_cand:.2f} | "
                  f"{t_full / t_cand:.1f}x | {differ} |")


if __name__ == "__main__":
    main()
