"""Structured outputs: what a grammar costs and what it buys, in one run (the engine in
process, the embedded model in the default mode: bfloat16, int4 matmuls).

- per-step decode time, constrained vs free, at batch 1 and 16: the same prompts, greedy,
  the same number of steps (the free runs ignore EOS; bursts off for both, so the
  difference is the mask: its computation per row and its application to the logits),
  and the free run with bursts on as the engine would run it;
- grammar compile time p50/p99 over the test schema set (a fresh cache each time; the
  llguidance tokenizer, built once per engine, reported apart);
- validity rate over the schema set, greedy: constrained vs free with the schema in the
  prompt only.

    .venv/bin/python benchmarks/structured.py [--steps 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import make_engine  # noqa: E402
from tests.server.test_structured_outputs import SCHEMAS  # noqa: E402
from tokenmill.engine.api import SamplingParams, StructuredOutput  # noqa: E402
from tokenmill.engine.structured import grammar as grammar_mod  # noqa: E402
from tokenmill.engine.structured.matchers import GrammarMatchers  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402

# a grammar that runs as long as the free text does: a JSON list of short strings
LONG = StructuredOutput("json", {"type": "object", "required": ["notes"], "additionalProperties": False,
                                 "properties": {"notes": {"type": "array", "maxItems": 200,
                                                          "items": {"type": "string", "maxLength": 40}}}})


def prompt_ids(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def decode_step_ms(loaded, batch: int, steps: int, spec: StructuredOutput | None, bursts: bool) -> float:
    """Mean ms per decode step once every request is decoding (a burst of k steps counts
    as k steps)."""
    engine = make_engine(loaded, num_blocks=1024, max_num_batched_tokens=2048, decode_steps=8 if bursts else 1)
    tok = loaded.tokenizer
    for i in range(batch):
        ids = prompt_ids(tok, f"Write notes about topic number {i}.")
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True,
                                                        structured=spec))
    engine.step()  # prefill (one step: the budget holds every prompt) and the first token
    n0, t0 = engine.steps, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return 1000 * (time.perf_counter() - t0) / max(1, engine.steps - n0)


def mask_cost_ms(loaded, batch: int, steps: int = 30) -> tuple[float, float]:
    """(ms a step for the masks of `batch` constrained rows: llguidance's bitmasks, then
    the sampler's unpack and fill; ms a step for sampling the same greedy rows free),
    on random logits: the grammar's own cost, apart from the model's step."""
    import torch

    from tokenmill.engine.sampler import SamplingBatch, TokenMask, sample

    V = loaded.config.vocab_size
    gm = GrammarMatchers(loaded.tokenizer, V, tuple(loaded.tokenizer.eos_token_ids))
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        gm.add(rid, LONG)
    logits = torch.randn(batch, V)
    free_b = SamplingBatch(temperature=torch.zeros(0), all_greedy=True)
    t_mask = t_free = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        sample(logits, free_b)
        t1 = time.perf_counter()
        b = SamplingBatch(temperature=torch.zeros(0), all_greedy=True)
        b.token_mask = TokenMask.from_bitmask(list(range(batch)), gm.fill_bitmask(ids), V)
        out = sample(logits, b)
        t2 = time.perf_counter()
        for rid, tok in zip(ids, out.token_ids):
            gm.accept(rid, tok)
        t3 = time.perf_counter()
        t_free += t1 - t0
        t_mask += (t2 - t1) + (t3 - t2)
    return 1000 * t_mask / steps, 1000 * t_free / steps


def compile_times(loaded) -> tuple[float, list[float]]:
    gm = GrammarMatchers(loaded.tokenizer, loaded.config.vocab_size, tuple(loaded.tokenizer.eos_token_ids))
    t0 = time.perf_counter()
    gm._ll_tokenizer()
    tok_s = time.perf_counter() - t0
    times = []
    grammar_mod._grammar.cache_clear()
    for s in SCHEMAS:
        spec = StructuredOutput("json", s)
        t0 = time.perf_counter()
        gm.compile(spec)
        times.append(time.perf_counter() - t0)
    return tok_s, times


def validity(loaded) -> tuple[int, int, int]:
    import jsonschema

    engine = make_engine(loaded, num_blocks=2048, max_num_batched_tokens=2048)
    tok = loaded.tokenizer
    for i, s in enumerate(SCHEMAS):
        ids = prompt_ids(tok, f"Reply with only a JSON value matching this JSON schema:\n{json.dumps(s)}")
        engine.add_request(f"f{i}", ids, SamplingParams(temperature=0, max_tokens=120))
        engine.add_request(f"c{i}", ids, SamplingParams(temperature=0, max_tokens=120,
                                                        structured=StructuredOutput("json", s)))
    texts: dict[str, str] = {}
    while engine.has_unfinished():
        for o in engine.step():
            texts[o.request_id] = texts.get(o.request_id, "") + o.text

    def valid(text: str, schema: dict) -> bool:
        text = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    free = sum(valid(texts[f"f{i}"], s) for i, s in enumerate(SCHEMAS))
    constrained = sum(valid(texts[f"c{i}"], s) for i, s in enumerate(SCHEMAS))
    return free, constrained, len(SCHEMAS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(None, "bfloat16", "int4")
    print("| batch | free, bursts on: ms/step | free: ms/step | constrained: ms/step | overhead |")
    print("|---|---|---|---|---|")
    for batch in (1, 16):
        runs = {"burst": [], "free": [], "json": []}
        for _ in range(args.repeat):  # interleaved, medians
            runs["burst"].append(decode_step_ms(loaded, batch, args.steps, None, True))
            runs["free"].append(decode_step_ms(loaded, batch, args.steps, None, False))
            runs["json"].append(decode_step_ms(loaded, batch, args.steps, LONG, False))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"| {batch} | {med['burst']:.2f} | {med['free']:.2f} | {med['json']:.2f} | "
              f"{100 * (med['json'] / med['free'] - 1):+.1f}% |")
    print("\n| batch | sampling, free: ms/step | masks + sampling + advance, constrained: ms/step |")
    print("|---|---|---|")
    for batch in (1, 16):
        mask, free = mask_cost_ms(loaded, batch)
        print(f"| {batch} | {free:.2f} | {mask:.2f} |")
    tok_s, times = compile_times(loaded)
    times.sort()
    p = lambda q: 1000 * times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    print(f"\ncompile over {len(times)} schemas: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max "
          f"{1000 * times[-1]:.1f} ms; llguidance tokenizer (once per engine) {1000 * tok_s:.0f} ms")
    free, constrained, n = validity(loaded)
    print(f"\nvalid JSON for the schema, greedy, {n} schemas: free (schema in the prompt) {free}/{n}, "
          f"constrained {constrained}/{n}")


if __name__ == "__main__":
    main()
