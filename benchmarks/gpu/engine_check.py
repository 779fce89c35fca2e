"""The engine's torch runner on a device (issue 46): tokens against the CPU, CUDA graphs
against eager, and decode throughput through LLMEngine (scheduler, KV manager, runner).

Runs from a checkout with no install and no native build (the torch runner needs no
native kernel): PyTorch, numpy and tokenizers. No model file: random weights on real
shapes (SmolLM2-135M's config; `--quick`: a tiny one). The JSON report is rewritten after
every phase.

    python -m benchmarks.gpu.engine_check --out $OUT/engine.json     # cuda
    python -m benchmarks.gpu.engine_check --device cpu --quick       # the script itself, on a CPU

Phases:
1. parity: 4 prompts batched, greedy, float32 weights with peaked logits (weights
   scaled so the top two logits are far apart), on the device and on the CPU (the torch
   runner there is tested in CI against the exact mode): tokens equal, chosen logprobs
   within 1e-3.
2. graphs: bf16, the same requests with CUDA graphs on and off: tokens equal.
3. decode_cN: C requests of 128 random prompt tokens, 128 output tokens each (no stop),
   bf16, graphs on and off: output tok/s over the whole run (prefill included).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import LoadedModel, _expected_shapes, build_model

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
            head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1024)


def random_model(shape: dict, dtype: torch.dtype, scale: float, seed: int = 0) -> LoadedModel:
    cfg = ModelConfig(architecture="llama", name="random", tie_word_embeddings=True, eos_token_ids=(0,), **shape)
    g = torch.Generator().manual_seed(seed)
    weights = {name: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * scale)
               for name, s in _expected_shapes(cfg).items()}
    return LoadedModel(build_model(cfg, weights, dtype), None, cfg, "random")


def engine(loaded: LoadedModel, device: str, graphs: bool, seqs: int, blocks: int) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=max(512, seqs), decode_steps=1),
        device=device, runner="torch", cuda_graphs=graphs))


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, dict, float]:
    """({rid: tokens}, {rid: chosen logprobs}, seconds)."""
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    while eng.has_unfinished():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(t.logprob for t in o.logprobs or [])
    if eng.config.device == "cuda":
        torch.cuda.synchronize()
    return toks, lps, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, quick = args.device, args.quick
    out = args.out or f"bench-results/gpu/engine-{dev}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                    "quick": quick, "phases": {}}

    def save(name: str, result: dict) -> None:
        report["phases"][name] = result
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
        print(name, json.dumps(result), flush=True)

    g = torch.Generator().manual_seed(1)
    shape = TINY if quick else SMOL
    prompts = [torch.randint(1, shape["vocab_size"], (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    peaked = random_model(shape, torch.float32, 0.5 if quick else 0.2)
    ref_toks, ref_lps, _ = run(engine(peaked, "cpu", False, 8, 64), prompts, params)
    peaked = random_model(shape, torch.float32, 0.5 if quick else 0.2)
    toks, lps, _ = run(engine(peaked, dev, True, 8, 64), prompts, params)
    err = max(abs(a - b) for r in lps for a, b in zip(lps[r], ref_lps[r]))
    save("parity", {"ok": toks == ref_toks and err < 1e-3, "tokens_equal": toks == ref_toks, "max_logprob_err": err})

    bf16 = random_model(shape, torch.bfloat16 if dev == "cuda" else torch.float32, 0.02)
    on, _, _ = run(engine(bf16, dev, True, 8, 64), prompts, params)
    off, _, _ = run(engine(bf16, dev, False, 8, 64), prompts, params)
    save("graphs", {"ok": on == off, "tokens_equal": on == off})

    n_in, n_out = (16, 16) if quick else (128, 128)
    for c in ((1, 4) if quick else (1, 16, 64)):
        ps = [torch.randint(1, shape["vocab_size"], (n_in,), generator=g).tolist() for _ in range(c)]
        sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        result = {}
        for graphs in (True, False):
            eng = engine(bf16, dev, graphs, max(c, 1), c * (-(-(n_in + n_out) // 16)) + 8)
            run(eng, ps[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
            _, _, s = run(eng, ps, sp)
            result["graphs" if graphs else "eager"] = {"seconds": round(s, 3), "output_tok_s": round(c * n_out / s, 1)}
        save(f"decode_c{c}", result)
    return 0 if all(p.get("ok", True) for p in report["phases"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
