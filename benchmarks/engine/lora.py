"""What LoRA adapters cost: decode throughput with 1, 4 and 16 distinct adapters in the
batch against the base model alone, in one engine, rounds interleaved.

The adapters are random, rank 16 on every projection (q, k, v, o, gate, up, down) of the
embedded SmolLM2 in the serving default (bfloat16, its int4 blocks), written as PEFT
folders. Every request decodes greedily with ignore_eos, so each configuration runs the
same number of tokens.

    python -m benchmarks.engine.lora [--rank 16] [--modules q_proj,v_proj] [--rounds 3] [--tokens 128] [--quick]

Prints single-stream decode tok/s (base, one adapter), output tok/s at 16 concurrent
streams (all base; 1, 4, 16 distinct adapters), the ratios to the base, an adapter's load
time and the bytes it adds to a step (read once per step by every row on it).
`--quick` (the tests' smoke run): rank 8, one round, 32 tokens, 4 streams.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import eval_ids
from tokenmill.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.loader import load_model
from tokenmill.model.lora import MODULES, module_shapes


def write_adapter(folder: Path, cfg, rank: int, seed: int, modules: tuple[str, ...] = MODULES) -> str:
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    tensors = {}
    for i in range(cfg.num_layers):
        for m in modules:
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out, inp = shapes[m]
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                            "target_modules": list(modules)}))
    return str(folder)


def decode_rate(engine: LLMEngine, prompts: list[list[int]], models: list[str | None], tokens: int) -> float:
    """Output tokens per second from the first token of the batch to the last."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, (ids, model) in enumerate(zip(prompts, models)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", ids, params, lora=model)
    first = last = None
    n = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first = first or now
                last = now
                n += len(o.new_token_ids)
    return (n - len(prompts)) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modules", default=",".join(MODULES),
                    help="projections the adapters target (default all 7; PEFT's default is q_proj,v_proj)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="smoke run: rank 8, one round, 32 tokens, 4 streams")
    args = ap.parse_args()
    if args.quick:
        args.rank, args.rounds, args.tokens, args.streams = 8, 1, 32, 4
    loaded = load_model(None, "bfloat16", "auto")
    cfg = loaded.config
    root = Path(tempfile.mkdtemp(prefix="tokenmill-lora-"))
    counts = sorted({1, min(4, args.streams), args.streams})
    modules = tuple(m.strip() for m in args.modules.split(",") if m.strip())
    if not modules or set(modules) - set(MODULES):
        raise SystemExit(f"--modules: choose among {', '.join(MODULES)}")
    paths = [(f"a{i}", write_adapter(root / f"a{i}", cfg, args.rank, i, modules)) for i in range(max(counts))]
    engine = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_gb=0.5),
                                            scheduler=SchedulerConfig(max_num_seqs=max(16, args.streams)),
                                            lora=LoraConfig((), max(counts), args.rank)))
    loads = [engine.load_adapter(name, path) for name, path in paths]
    ids = eval_ids(loaded.tokenizer)
    prompts = [ids[40 * i:40 * i + 32] for i in range(args.streams)]
    configs = {"base": [None] * args.streams}
    for c in counts:
        configs[f"{c} adapter{'s' if c > 1 else ''}"] = [paths[i % c][0] for i in range(args.streams)]
    decode_rate(engine, prompts[:2], [None, "a0"], 8)  # warm-up
    single: dict[str, list[float]] = {"base": [], "adapter": []}
    batch: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(args.rounds):  # interleaved: drift in the machine's speed hits every configuration alike
        for name, model in (("base", None), ("adapter", "a0")):
            single[name].append(decode_rate(engine, prompts[:1], [model], args.tokens))
        for name, models in configs.items():
            batch[name].append(decode_rate(engine, prompts, models, args.tokens))
    engine.close()
    med = statistics.median
    print(f"LoRA rank {args.rank} on {'all 7 projections' if len(modules) == len(MODULES) else '+'.join(modules)}, "
          f"{cfg.name}, bfloat16 + int4 blocks, "
          f"{args.tokens} tokens, median of {args.rounds} rounds")
    print("| configuration | output tok/s | vs base |")
    print("|---|---|---|")
    base1 = med(single["base"])
    print(f"| single stream, base | {base1:.1f} | 1.00x |")
    print(f"| single stream, one adapter | {med(single['adapter']):.1f} | {med(single['adapter']) / base1:.2f}x |")
    baseN = med(batch["base"])
    for name, rates in batch.items():
        print(f"| {args.streams} streams, {name} | {med(rates):.1f} | {med(rates) / baseN:.2f}x |")
    print(f"adapter load: median {med(a.load_seconds for a in loads) * 1000:.0f} ms; "
          f"{loads[0].nbytes / 2 / 2 ** 20:.1f} MiB of bfloat16 A and B each, read by a step per distinct adapter "
          f"(the base model's weights: {loaded.model.weight_bytes / 2 ** 20:.1f} MiB)")


if __name__ == "__main__":
    main()
