"""The device check: a paged-KV decoder in plain PyTorch (benchmarks/gpu/paged.py) against
transformers on one device, with random weights from real configs, in one run.

    python -m benchmarks.gpu.check [--device cuda|cpu] [--quick] [--out FILE.json]
                                   [--models SmolLM2-135M,Qwen2.5-0.5B] [--budget-s 450]

Needs PyTorch and transformers only (no tokenmill import, no native build, no model file,
no network). Per model (SmolLM2-135M's and Qwen2.5-0.5B's configs; --quick: a tiny config
of each architecture): parity (teacher-forced logits within bf16 tolerance of a float32
copy, greedy tokens equal but at near ties), batched equals alone, decode tok/s at C = 1,
16, 64, 256 (128 + 128 tokens, no stop) with CUDA graphs on and off against transformers'
`generate`, and TTFT of a 512-token prompt. The JSON report is rewritten after every
phase, so a run cut off still reports. On a CPU the bucketed decode step runs eagerly (no
CUDA graphs). Exit status 0 when every check held. docs/gpu.md says how to read it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.gpu.paged import Blocks, DecodeGraphs, PagedDecoder, make_batch

# Real configs (the published config.json values); vocab, sizes, heads, RoPE and norms.
CONFIGS: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True),
    "Qwen2.5-0.5B": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True),
}
# --quick: the same two architectures (Qwen2's qkv bias, GQA groups of 2 and 4), tiny
TINY: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=1024, tie_word_embeddings=True),
    "tiny-qwen2": dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=1024, tie_word_embeddings=True),
}
FULL = dict(parity_prompt=64, parity_gen=32, batched_lens=(5, 17, 33, 64), batched_gen=16,
            batches=(1, 16, 64, 256), prompt=128, gen=128, ttft_prompt=512, repeats=2)
QUICK = dict(parity_prompt=16, parity_gen=8, batched_lens=(3, 9, 17), batched_gen=8,
             batches=(1, 4), prompt=16, gen=16, ttft_prompt=64, repeats=1)
BLOCK = 16
ATTENTION_STD = 2.0  # of q.k / sqrt(head size) over random weights and inputs (see build)
BF16_ULP = 2.0 ** -7  # bf16's spacing relative to a value, at worst


class Check:
    """The run's state, its JSON report and the phase runner."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.sizes = QUICK if args.quick else FULL
        self.t0 = time.perf_counter()
        self.ok = True
        self.report: dict[str, Any] = {
            "tool": "benchmarks/gpu/check.py", "argv": sys.argv[1:], "quick": args.quick,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "environment": environment(self.device),
            "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in self.sizes.items()},
            "phases": [], "done": False}
        self.write()

    def write(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(out)  # a reader never sees half a file

    def phase(self, name: str, model: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        elapsed = time.perf_counter() - self.t0
        entry: dict[str, Any] = {"phase": name, "model": model}
        if elapsed > self.args.budget_s:
            entry.update(status="skipped", reason=f"over the {self.args.budget_s:.0f} s budget")
            result = None
        else:
            t = time.perf_counter()
            try:
                result = fn()
                entry.update(status="ok" if result.pop("passed", True) else "FAILED", **result)
            except Exception as exc:  # noqa: BLE001 (reported, and the next phase still runs)
                result = None
                entry.update(status="error", error=repr(exc), traceback=traceback.format_exc()[-2000:])
            entry["seconds"] = round(time.perf_counter() - t, 3)
        self.ok &= entry["status"] in ("ok", "skipped")
        self.report["phases"].append(entry)
        self.write()
        print(f"[check] {model} {name}: {entry['status']} ({entry.get('seconds', 0):.1f} s) "
              + json.dumps({k: v for k, v in entry.items() if k in SUMMARY_KEYS}, default=str), flush=True)
        return result


SUMMARY_KEYS = ("logits", "greedy", "tokens_equal", "ours_graphs", "ours_eager", "transformers", "ratios",
                "capture", "reason", "error", "ours_ms", "transformers_ms")


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "device": str(device), "cpus": os.cpu_count()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(spec: dict[str, Any], device: torch.device, seed: int = 0):
    """transformers' model with its own random initialisation, bf16, on the device."""
    import transformers

    kwargs = {k: v for k, v in spec.items() if k != "arch"}
    cls = transformers.LlamaConfig if spec["arch"] == "llama" else transformers.Qwen2Config
    cfg = cls(**kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(device).eval()  # (a no-op where the device context placed it already)
    # The default initialisation (std 0.02) makes attention scores tiny (std hidden * 0.02^2:
    # 0.23 for SmolLM2), so every head attends almost uniformly and a wrong position,
    # rotation or head mapping would change nothing measurable. q and k scaled so the
    # scores' std is about ATTENTION_STD: the check sees attention actually select.
    std = cfg.initializer_range
    factor = (ATTENTION_STD / (cfg.hidden_size * std * std)) ** 0.5
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(factor)
    return model


def prefill(model: PagedDecoder, prompts: list[list[int]], tables: torch.Tensor,
            all_logits: bool = False) -> torch.Tensor:
    return model.forward(make_batch([(p, 0) for p in prompts], tables, BLOCK, model.device), all_logits)


def hf_generate(hf, prompts: torch.Tensor, new: int) -> torch.Tensor:
    return hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)[:, prompts.shape[1]:]


def random_ids(n: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).to(device)


def tolerance(ref: torch.Tensor, bf16: torch.Tensor) -> tuple[float, float]:
    """(bf16 tolerance, transformers' own bf16 error): twice what bf16 costs transformers,
    at least two bf16 ulps of the largest logit."""
    noise = float((bf16.float() - ref).abs().max())
    return max(2 * noise, 2 * BF16_ULP * float(ref.abs().max())), noise


def parity(hf, ref, model: PagedDecoder, sizes: dict[str, Any], seed: int) -> dict[str, Any]:
    dev, vocab = model.device, hf.config.vocab_size
    p, n = sizes["parity_prompt"], sizes["parity_gen"]
    prompt = random_ids(p, vocab, seed, dev)
    theirs = hf_generate(hf, prompt[None], n)[0]
    seq = torch.cat([prompt, theirs])
    fp32 = ref(seq[None, :-1]).logits[0].float()  # [P + N - 1, V]
    tf_bf16 = hf(seq[None, :-1]).logits[0]
    tol, noise = tolerance(fp32, tf_bf16)
    # ours, teacher-forced: the prompt through the prefill path, then theirs one decode step each
    table = Blocks(model.num_blocks, BLOCK, seed).table(p + n)[None]
    logits = [prefill(model, [prompt.tolist()], table, all_logits=True)]
    for i in range(p, p + n - 1):
        logits.append(model.forward(make_batch([([int(seq[i])], i)], table, BLOCK, dev)))
    ours_tf = torch.cat(logits).float()
    err = float((ours_tf - fp32).abs().max())
    # ours, free-running greedy (the same block table: the cache is rewritten as it goes)
    tok = int(prefill(model, [prompt.tolist()], table).argmax(-1))
    mine = [tok]
    for i in range(p, p + n - 1):
        tok = int(model.forward(make_batch([([tok], i)], table, BLOCK, dev)).argmax(-1))
        mine.append(tok)

    def near_tie(pos: int, a: int, b: int) -> bool:
        return abs(float(fp32[pos, a] - fp32[pos, b])) <= tol

    gen_pos = range(p - 1, p + n - 1)  # logits rows that chose the generated tokens
    tf_argmax = ours_tf[list(gen_pos)].argmax(-1).tolist()
    tf_unexplained = sum(1 for i, pos in enumerate(gen_pos)
                         if tf_argmax[i] != int(theirs[i]) and not near_tie(pos, tf_argmax[i], int(theirs[i])))
    first = next((i for i in range(n) if mine[i] != int(theirs[i])), None)
    free_ok = first is None or near_tie(p - 1 + first, mine[first], int(theirs[first]))
    logits_ok = err <= tol
    hf_flips = int((tf_bf16.float().argmax(-1) != fp32.argmax(-1)).sum())
    return {"passed": logits_ok and free_ok and tf_unexplained == 0,
            "logits": {"ok": logits_ok, "max_abs_err_vs_fp32": err, "tolerance": tol,
                       "transformers_bf16_err_vs_fp32": noise,
                       "mean_abs_err_vs_fp32": float((ours_tf - fp32).abs().mean()),
                       "transformers_bf16_mean_abs_err": float((tf_bf16.float() - fp32).abs().mean()),
                       "max_abs_diff_vs_transformers_bf16": float((ours_tf - tf_bf16.float()).abs().max()),
                       "fp32_logit_absmax": float(fp32.abs().max()), "positions": int(fp32.shape[0])},
            "greedy": {"ok": free_ok and tf_unexplained == 0, "tokens": n, "free_run_equal": first is None,
                       "first_divergence": first, "divergence_is_near_tie": None if first is None else free_ok,
                       "teacher_forced_argmax_differs": sum(a != int(b) for a, b in zip(tf_argmax, theirs)),
                       "teacher_forced_unexplained": tf_unexplained,
                       "transformers_bf16_argmax_flips_vs_fp32": hf_flips}}


def batched(ref, model: PagedDecoder, sizes: dict[str, Any], capture: bool, seed: int) -> dict[str, Any]:
    dev, vocab = model.device, ref.config.vocab_size
    lens, n = sizes["batched_lens"], sizes["batched_gen"]
    prompts = [random_ids(k, vocab, seed + i, dev).tolist() for i, k in enumerate(lens)]
    width = -(-(max(lens) + n) // BLOCK)
    graphs = DecodeGraphs(model, len(lens), width, capture)
    blocks = Blocks(model.num_blocks, BLOCK, seed)

    def run(group: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tables = torch.stack([blocks.table(lens[i] + n, width) for i in group])
        first = prefill(model, [prompts[i] for i in group], tables)
        rest = graphs.run(first.argmax(-1), torch.tensor([lens[i] for i in group], device=dev), tables.to(dev), n - 1)
        return first.float(), torch.cat([first.argmax(-1)[None], rest]).T  # [B, V], [B, n]

    together_logits, together = run(list(range(len(lens))))
    alone = [run([i]) for i in range(len(lens))]
    alone_logits = torch.cat([a[0] for a in alone])
    alone_tokens = torch.cat([a[1] for a in alone])
    diffs, unexplained = [], 0
    for i, k in enumerate(lens):
        d = next((j for j in range(n) if together[i, j] != alone_tokens[i, j]), None)
        diffs.append(d)
        if d is not None:  # a near tie in the float32 reference along the alone sequence?
            seq = torch.tensor(prompts[i] + alone_tokens[i, :d].tolist(), device=dev)
            row = ref(seq[None]).logits[0, -1].float()
            tol = 2 * BF16_ULP * float(row.abs().max())
            unexplained += abs(float(row[together[i, d]] - row[alone_tokens[i, d]])) > tol
    return {"passed": unexplained == 0, "tokens_equal": all(d is None for d in diffs),
            "first_divergence": diffs, "unexplained_divergences": unexplained, "lengths": list(lens),
            "prefill_logits_max_abs_diff": float((together_logits - alone_logits).abs().max()),
            "graphs": "captured" if capture else "eager (no CUDA graphs)"}


def speed(hf, model: PagedDecoder, graphs: dict[bool, DecodeGraphs], c: int, sizes: dict[str, Any],
          seed: int) -> dict[str, Any]:
    dev, vocab = model.device, hf.config.vocab_size
    p, n = sizes["prompt"], sizes["gen"]
    prompts = torch.stack([random_ids(p, vocab, seed + i, dev) for i in range(c)])
    width = -(-(p + n) // BLOCK)
    out: dict[str, Any] = {"concurrency": c, "prompt_tokens": p, "output_tokens": n}
    tokens = {}
    for on, g in graphs.items():
        runs = []
        for r in range(sizes["repeats"] + 1):  # the first run warms up
            blocks = Blocks(model.num_blocks, BLOCK, seed + r)
            tables = torch.stack([blocks.table(p + n, width) for _ in range(c)]).to(dev)
            sync(dev)
            t0 = time.perf_counter()
            first = prefill(model, prompts.tolist(), tables).argmax(-1)
            sync(dev)
            t1 = time.perf_counter()
            rest = g.run(first, torch.full((c,), p, device=dev), tables, n - 1)
            sync(dev)
            t2 = time.perf_counter()
            if r:
                runs.append((t1 - t0, t2 - t1))
            tokens[on] = torch.cat([first[None], rest])
        pre, dec = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        out["ours_graphs" if on else "ours_eager"] = {
            "prefill_s": pre, "decode_s": dec, "output_tok_s": c * n / (pre + dec),
            "decode_tok_s": c * (n - 1) / dec, "step_ms": 1000 * dec / (n - 1),
            "bucket": g.bucket(c), "cuda_graphs": bool(g.graphs)}
    if len(tokens) == 2:
        out["tokens_equal"] = bool(torch.equal(tokens[True], tokens[False]))
    hf_generate(hf, prompts, 4)  # warm-up
    sync(dev)
    t0 = time.perf_counter()
    hf_generate(hf, prompts, n)
    sync(dev)
    total = time.perf_counter() - t0
    out["transformers"] = {"total_s": total, "output_tok_s": c * n / total, "step_ms": 1000 * total / n}
    best = out.get("ours_graphs") or out["ours_eager"]
    out["ratios"] = {"output_tok_s_vs_transformers": best["output_tok_s"] / out["transformers"]["output_tok_s"]}
    if "ours_graphs" in out:
        out["ratios"]["graphs_vs_eager_decode"] = out["ours_graphs"]["decode_tok_s"] / out["ours_eager"]["decode_tok_s"]
    out["passed"] = out.get("tokens_equal", True)
    return out


def ttft(hf, model: PagedDecoder, sizes: dict[str, Any], seed: int) -> dict[str, Any]:
    dev, vocab, p = model.device, hf.config.vocab_size, sizes["ttft_prompt"]
    ours, theirs = [], []
    for r in range(6):  # the first of each warms up
        prompt = random_ids(p, vocab, seed + r, dev)
        table = Blocks(model.num_blocks, BLOCK, seed + r).table(p)[None]
        sync(dev)
        t0 = time.perf_counter()
        int(prefill(model, [prompt.tolist()], table).argmax(-1))  # the host has the token
        t1 = time.perf_counter()
        int(hf_generate(hf, prompt[None], 1)[0, 0])
        t2 = time.perf_counter()
        if r:
            ours.append(1000 * (t1 - t0))
            theirs.append(1000 * (t2 - t1))
    return {"prompt_tokens": p, "ours_ms": statistics.median(ours), "transformers_ms": statistics.median(theirs)}


def check_model(chk: Check, name: str, spec: dict[str, Any]) -> None:
    dev, sizes, seed = chk.device, chk.sizes, chk.args.seed
    built: dict[str, Any] = {}

    def make() -> dict[str, Any]:
        built["hf"] = hf = build(spec, dev, seed)
        return {"parameters": sum(x.numel() for x in hf.parameters()), "config": spec}

    if chk.phase("build", name, make) is None:
        return
    hf = built.pop("hf")
    span = lambda tokens: -(-tokens // BLOCK)  # noqa: E731 (blocks for that many tokens)
    blocks = max(max(sizes["batches"]) * span(sizes["prompt"] + sizes["gen"]), span(sizes["ttft_prompt"]),
                 len(sizes["batched_lens"]) * 2 * span(max(sizes["batched_lens"]) + sizes["batched_gen"]))
    model = PagedDecoder(hf, num_blocks=blocks + 1, block_size=BLOCK)  # + the scratch block
    ref = copy.deepcopy(hf).float()  # the same (bf16-rounded) weights in float32
    chk.phase("parity", name, lambda: parity(hf, ref, model, sizes, seed))
    chk.phase("batched_equals_alone", name, lambda: batched(ref, model, sizes, dev.type == "cuda", seed))
    ref = None  # the float32 copy is not needed past here: its memory back before timing
    width = span(sizes["prompt"] + sizes["gen"])
    graphs: dict[bool, DecodeGraphs] = {}

    def capture() -> dict[str, Any]:
        graphs[False] = DecodeGraphs(model, max(sizes["batches"]), width, capture=False)
        if dev.type != "cuda":
            return {"capture": {"buckets": graphs[False].buckets, "note": "no CUDA: the buckets run eagerly"}}
        g = graphs[True] = DecodeGraphs(model, max(sizes["batches"]), width, capture=True)
        return {"capture": {"buckets": g.buckets, "seconds": g.capture_s, "pool_mib": g.pool_bytes / 2**20}}

    if chk.phase("cuda_graphs_capture", name, capture) is not None:
        for c in sizes["batches"]:
            chk.phase(f"decode_c{c}", name, lambda c=c: speed(hf, model, graphs, c, sizes, seed))
    chk.phase("ttft", name, lambda: ttft(hf, model, sizes, seed))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny configs and sizes (CI runs it on a CPU)")
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(CONFIGS)} (--quick: "
                                                   f"{', '.join(TINY)})")
    ap.add_argument("--out", default=None, help="the JSON report (default bench-results/gpu/check-DEVICE.json)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no phase after this many seconds (default 450; --quick 60)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = TINY if args.quick else CONFIGS
    names = args.models.split(",") if args.models else list(table)
    unknown = [m for m in names if m not in table]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(table)}")
    args.out = args.out or f"bench-results/gpu/check-{args.device}{'-quick' if args.quick else ''}.json"
    args.budget_s = args.budget_s or (60.0 if args.quick else 450.0)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device here (use --device cpu)")
    chk = Check(args)
    print(f"[check] {chk.report['environment']}; report: {args.out}", flush=True)
    with torch.inference_mode():
        for name in names:
            check_model(chk, name, table[name])
            if chk.device.type == "cuda":
                torch.cuda.empty_cache()  # the model's memory back before the next one
    chk.report.update(done=True, ok=chk.ok, seconds=round(time.perf_counter() - chk.t0, 1))
    chk.write()
    print(f"[check] {'all checks held' if chk.ok else 'SOME CHECKS FAILED'} in {chk.report['seconds']} s; "
          f"wrote {args.out}", flush=True)
    return 0 if chk.ok else 1


if __name__ == "__main__":
    sys.exit(main())
