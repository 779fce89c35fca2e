"""What the prefix cache's disk tier saves: TTFT of a returning long prompt whose blocks
left memory (evicted by other prompts) and after a restart, read back from disk, against
recomputing it cold. Files are read from the OS page cache where it still holds them
(a machine's first read after a reboot comes from the device).

    python -m benchmarks.engine.kv_disk [--config serve] [--prompt-tokens 2500] [--repeat 3] [--quick]
                                        [--model qwen2.5-coder-1.5b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks.common import CONFIGS, eval_ids
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.loader import load_model

ONE = SamplingParams(max_tokens=1, temperature=0)
SLACK_BLOCKS = 8  # of a pool beyond one prompt: up to this many of an evicted prompt's blocks stay in memory
PRECISIONS = dict(CONFIGS, serve=("bfloat16", "auto"))  # serve: what `tokenmill serve` runs by default


def ttft(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[float, int]:
    engine.add_request(rid, prompt, ONE)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.times.first_token - out.times.arrival, out.num_cached_tokens
    raise AssertionError("no output")


def engine(loaded, root: str | None, prompt_tokens: int) -> LLMEngine:
    # a pool of one prompt and a little: the next prompt evicts the last one's blocks
    blocks = prompt_tokens // 16 + SLACK_BLOCKS
    cache = CacheConfig(num_blocks=blocks, kv_disk_dir=root, kv_disk_gb=4.0)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=512)))


def decode_rate(loaded, root: str | None, prompt: list[int], tokens: int) -> float:
    """Single-stream greedy decode, tokens/s (with a tier: every block written as it fills)."""
    cache = CacheConfig(kv_cache_gb=0.5, kv_disk_dir=root, kv_disk_gb=4.0)
    e = LLMEngine(loaded, EngineConfig(cache=cache))
    ttft(e, prompt[:32], "warm-up")
    e.add_request("d", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    first = last = None
    while e.has_unfinished():
        for out in e.step():
            last = time.perf_counter()
            first = first or last
    e.close()
    return (tokens - 1) / (last - first)


def streams_during_restore(loaded, root: str, prompt: list[int], n: int) -> tuple[float, float]:
    """A stream decodes while a returning prompt's prefix is read from disk: the median gap
    (ms) between the stream's outputs before, and the longest over the 5 from the arrival."""
    e = engine(loaded, root, n + 64 + 400)  # room for both: the read, not a preemption, is measured
    ttft(e, prompt, "first")
    e.kv.reset_prefix_cache()  # memory forgets it; its files stay
    e.add_request("stream", prompt[:64], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    times, at = [], None
    while e.has_unfinished():
        outs = e.step()
        now = time.perf_counter()
        times += [now for out in outs if out.request_id == "stream" and out.new_token_ids]
        if len(times) >= 20 and at is None:  # (outputs: a step's, decode bursts included)
            e.add_request("back", prompt, ONE)  # a memory miss, its blocks on disk
            at = len(times) - 1
    e.close()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps[:at]) * 1000, max(gaps[at:at + 5]) * 1000


def memory_vs_disk(loaded, root: str, prompt: list[int], n: int, repeat: int) -> tuple[float, float, float]:
    """TTFT of a prompt whose prefix is in memory, and read back from disk (memory told to
    forget it), in one engine, interleaved; and the read alone (medians, seconds)."""
    e = engine(loaded, root, n)
    ttft(e, prompt, "first")
    disk, mem, reads = [], [], []
    for i in range(repeat):
        e.kv.reset_prefix_cache()
        before = e.stats().kv_disk_restore_seconds
        disk.append(ttft(e, prompt, f"disk{i}")[0])
        reads.append(e.stats().kv_disk_restore_seconds - before)
        mem.append(ttft(e, prompt, f"mem{i}")[0])
    e.close()
    return statistics.median(mem), statistics.median(disk), statistics.median(reads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="serve", choices=sorted(PRECISIONS))
    ap.add_argument("--prompt-tokens", type=int, default=2500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: a 256-token prompt, one repeat, 32 tokens")
    ap.add_argument("--model", default=None, help="an installed model's name or a model file (default: the "
                                                  "embedded one), run as serve runs it (its file's quantization)")
    args = ap.parse_args()
    decode_prompt, decode_tokens = 2000, 256
    if args.quick:
        args.prompt_tokens, args.repeat, decode_prompt, decode_tokens = 256, 1, 256, 32
    dtype, quant = PRECISIONS[args.config]
    if args.model is not None:
        from tokenmill.model.registry import resolve

        args.model, quant = resolve(args.model), "auto"
    loaded = load_model(args.model, dtype, quant)
    ids = eval_ids(loaded.tokenizer)
    while len(ids) < args.prompt_tokens * (2 * args.repeat + 2):
        ids = ids + list(reversed(ids))
    n = args.prompt_tokens
    prompts = [ids[i * n:(i + 1) * n] for i in range(2 * args.repeat + 1)]
    root = tempfile.mkdtemp(prefix="tokenmill-kvdisk-")

    e = engine(loaded, root, n)
    ttft(e, ids[-64:], "warm-up")
    cold, evicted, restarted, restore = [], [], [], []
    for i in range(args.repeat):
        p, other = prompts[2 * i], prompts[2 * i + 1]
        t, c = ttft(e, p, f"cold{i}")
        assert c == 0, c
        cold.append(t)
        ttft(e, other, f"other{i}")  # its blocks push p's out of memory
        before = e.stats()
        t, c = ttft(e, p, f"back{i}")
        after = e.stats()
        # from disk, all but what the pool's slack kept in memory
        assert after.kv_disk_hit_tokens - before.kv_disk_hit_tokens >= n - 16 * (SLACK_BLOCKS + 1), (c, after)
        evicted.append(t)
        restore.append(after.kv_disk_restore_seconds - before.kv_disk_restore_seconds)
    e.close()
    hit = []
    for i in range(args.repeat):
        e = engine(loaded, root, n)  # a restart: a fresh engine on the directory
        ttft(e, ids[-64:], "warm-up")
        t, c = ttft(e, prompts[2 * i], f"restart{i}")
        restarted.append(t)
        hit.append(c)
        e.close()
    used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    med = statistics.median
    print(f"{os.path.basename(args.model or 'the embedded model')}, {args.config}, {n}-token prompt, "
          f"median of {args.repeat} (TTFT, seconds):")
    print(f"  cold recompute               {med(cold):8.3f}")
    print(f"  evicted, read back from disk {med(evicted):8.3f}  ({med(cold) / med(evicted):.1f}x; "
          f"restore {med(restore) * 1000:.0f} ms)")
    print(f"  after a restart, from disk   {med(restarted):8.3f}  ({med(cold) / med(restarted):.1f}x; "
          f"{min(hit)} tokens cached)")
    print(f"  disk: {used / 2 ** 20:.0f} MiB for {len(prompts)} prompts in {root}")
    mem, disk, read = memory_vs_disk(loaded, tempfile.mkdtemp(prefix="tokenmill-kvdisk-"), prompts[0], n,
                                     2 * args.repeat)
    print(f"  in one engine: prefix in memory {mem:.3f}, read back from disk {disk:.3f} (the read {read * 1000:.0f} ms)")
    before, worst = streams_during_restore(loaded, tempfile.mkdtemp(prefix="tokenmill-kvdisk-"), prompts[0], n)
    print(f"  a decoding stream's output gaps: median {before:.1f} ms, longest {worst:.1f} ms in the 5 after a "
          "read began")
    off, on = [], []
    for _ in range(args.repeat):  # interleaved, so drift in the machine's speed hits both alike
        off.append(decode_rate(loaded, None, prompts[1][:decode_prompt], decode_tokens))
        on.append(decode_rate(loaded, tempfile.mkdtemp(prefix="tokenmill-kvdisk-"), prompts[1][:decode_prompt],
                              decode_tokens))
    print(f"  single-stream decode, {decode_tokens} tokens after a {decode_prompt}-token prompt (whose writes "
          "overlap them): "
          f"{med(off):.1f} tok/s without the tier, {med(on):.1f} with write-through "
          f"({(1 - med(on) / med(off)) * 100:+.1f}% slower)")


if __name__ == "__main__":
    main()
