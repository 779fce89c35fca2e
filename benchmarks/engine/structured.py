"""Structured outputs: what a grammar costs and what it buys, in one run (the engine in
process, the embedded model in the default mode: bfloat16, int4 matmuls).

- per-step decode time, constrained vs free, at batch 1 and 16: the same prompts, greedy,
  the same number of steps (the free runs ignore EOS; bursts off for both, so the
  difference is the mask: its computation per row and its application to the logits),
  and the free run with bursts on as the engine would run it;
- grammar compile time p50/p99 over the schema set (benchmarks/data/json_schemas.json,
  the set tests/server/test_structured_outputs.py checks; a fresh cache each time; the
  llguidance tokenizer, built once per engine, reported apart);
- validity rate over the schema set, greedy: constrained vs free with the schema in the
  prompt only.

    .venv/bin/python -m benchmarks.engine.structured [--steps 64] [--repeat 3] [--quick]

`--quick` (the tests' smoke run): 8 steps at batch 1 and 4, one round, 4 schemas.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams, StructuredOutput
from tokenmill.engine.llm import LLM
# the grammar's own cost is timed on the engine's parts, apart from a model step
from tokenmill.engine.structured import grammar as grammar_mod
from tokenmill.engine.structured.matchers import GrammarMatchers
from tokenmill.model.loader import load_model

SCHEMAS: list[dict] = json.loads((Path(__file__).resolve().parents[1] / "data" / "json_schemas.json").read_text())

# a grammar that runs as long as the free text does: a JSON list of short strings
LONG = StructuredOutput("json", {"type": "object", "required": ["notes"], "additionalProperties": False,
                                 "properties": {"notes": {"type": "array", "maxItems": 200,
                                                          "items": {"type": "string", "maxLength": 40}}}})


def prompt_ids(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def engine(loaded, num_blocks: int, decode_steps: int = SchedulerConfig.decode_steps) -> LLM:
    return LLM(loaded, config=EngineConfig(cache=CacheConfig(num_blocks=num_blocks),
                                           scheduler=SchedulerConfig(max_num_batched_tokens=2048,
                                                                     decode_steps=decode_steps)))


def decode_step_ms(loaded, batch: int, steps: int, spec: StructuredOutput | None, bursts: bool) -> float:
    """Median over the requests of ms per output token after the first: the budget holds
    every prompt, so all prefill in one step and decode together, and that is the step
    time (a burst of k steps counts as k steps; up to `steps` of them)."""
    llm = engine(loaded, 1024, decode_steps=8 if bursts else 1)
    prompts = [prompt_ids(loaded.tokenizer, f"Write notes about topic number {i}.") for i in range(batch)]
    res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True,
                                               structured=spec))
    # a grammar may end its JSON early (the free runs ignore EOS and always run `steps`)
    per_step = [(o.times.finished - o.times.first_token) / (len(o.token_ids) - 1)
                for o in (r.outputs[0] for r in res) if len(o.token_ids) > 1]
    return 1000 * statistics.median(per_step)


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


def compile_times(loaded, schemas: list[dict]) -> tuple[float, list[float]]:
    gm = GrammarMatchers(loaded.tokenizer, loaded.config.vocab_size, tuple(loaded.tokenizer.eos_token_ids))
    t0 = time.perf_counter()
    gm._ll_tokenizer()
    tok_s = time.perf_counter() - t0
    times = []
    grammar_mod._grammar.cache_clear()
    for s in schemas:
        spec = StructuredOutput("json", s)
        t0 = time.perf_counter()
        gm.compile(spec)
        times.append(time.perf_counter() - t0)
    return tok_s, times


def validity(loaded, schemas: list[dict], max_tokens: int = 120) -> tuple[int, int, int]:
    import jsonschema

    llm = engine(loaded, 2048)
    tok = loaded.tokenizer
    prompts, params = [], []
    for s in schemas:
        ids = prompt_ids(tok, f"Reply with only a JSON value matching this JSON schema:\n{json.dumps(s)}")
        prompts += [ids, ids]
        params += [SamplingParams(temperature=0, max_tokens=max_tokens),
                   SamplingParams(temperature=0, max_tokens=max_tokens, structured=StructuredOutput("json", s))]
    res = llm.generate(prompts, params)
    texts = {f"{'fc'[j % 2]}{j // 2}": r.outputs[0].text for j, r in enumerate(res)}

    def valid(text: str, schema: dict) -> bool:
        text = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    free = sum(valid(texts[f"f{i}"], s) for i, s in enumerate(schemas))
    constrained = sum(valid(texts[f"c{i}"], s) for i, s in enumerate(schemas))
    return free, constrained, len(schemas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 steps at batch 1 and 4, one round, "
                                                         "4 schemas")
    args = ap.parse_args()
    batches, schemas, max_tokens = (1, 16), SCHEMAS, 120
    if args.quick:
        args.steps, args.repeat, batches, schemas, max_tokens = 8, 1, (1, 4), SCHEMAS[:4], 60
    loaded = load_model(None, "bfloat16", "int4")
    print("| batch | free, bursts on: ms/step | free: ms/step | constrained: ms/step | overhead |")
    print("|---|---|---|---|---|")
    for batch in batches:
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
    for batch in batches:
        mask, free = mask_cost_ms(loaded, batch)
        print(f"| {batch} | {free:.2f} | {mask:.2f} |")
    tok_s, times = compile_times(loaded, schemas)
    times.sort()
    p = lambda q: 1000 * times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    print(f"\ncompile over {len(times)} schemas: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max "
          f"{1000 * times[-1]:.1f} ms; llguidance tokenizer (once per engine) {1000 * tok_s:.0f} ms")
    free, constrained, n = validity(loaded, schemas, max_tokens)
    print(f"\nvalid JSON for the schema, greedy, {n} schemas: free (schema in the prompt) {free}/{n}, "
          f"constrained {constrained}/{n}")


if __name__ == "__main__":
    main()
