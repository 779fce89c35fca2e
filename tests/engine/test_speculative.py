"""Speculative decoding changes speed, never the output: greedy and seeded sampled tokens
are the same with speculation off, ngram and suffix, alone and in batches, through stops,
length limits, n > 1 and aborts; no KV block leaks; the verification keeps the target
distribution (chi-square); proposers find what they should and keep tenants apart."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.spec.proposers import NgramProposer, SuffixProposer
from tests.helpers import run_to_completion, tiny_loaded

METHODS = ("off", "ngram", "suffix")

# Prompts the embedded model answers with text it repeats (lists, a quoted passage) and
# one it answers freely: drafts are accepted and rejected
PASSAGE = ("The lighthouse keeper climbs the stairs at dusk. He cleans the lens, trims the wick and "
           "writes the weather in the log. The lighthouse keeper climbs the stairs at dawn. He cleans "
           "the lens, trims the wick and writes the weather in the log.")
CHATS = [
    "Repeat this text exactly:\n\n" + PASSAGE,
    "List the numbers from 1 to 30, one per line, each followed by its square.",
    "Write a short story about a cat who learns to fly.",
    "Copy this list and add a fourth item in the same style:\n- red apples, 3 per bag\n"
    "- green apples, 4 per bag\n- yellow apples, 5 per bag",
]


def _engine(loaded, method: str, *, max_num_seqs: int = 32, num_blocks: int = 512, **spec) -> LLMEngine:
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                  speculative=SpeculativeConfig(method=method, **spec)))
    return LLMEngine(loaded, cfg)


def _prompts(loaded) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
            for c in CHATS]


def _run(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]):
    def check(e):
        e.kv.check_integrity()

    tokens, texts, finish = run_to_completion(engine, reqs, check)
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0, "blocks still held after every request ended"
    return tokens, texts, finish


def _accepted(engine: LLMEngine) -> int:
    return engine.stats().spec_accepted_tokens


@pytest.mark.slow
def test_greedy_alone_and_in_a_batch_of_16_equal_without_speculation(smol_int4):
    prompts = _prompts(smol_int4)
    greedy = SamplingParams(temperature=0.0, max_tokens=96)
    alone: dict[str, dict] = {}
    batched: dict[str, dict] = {}
    for method in METHODS:
        eng = _engine(smol_int4, method)
        alone[method] = {f"r{i}": _run(eng, {f"r{i}": (p, greedy)})[0][f"r{i}"] for i, p in enumerate(prompts)}
        eng = _engine(smol_int4, method)
        # 16 requests: each prompt four times, with different lengths and stops
        reqs = {}
        for i in range(16):
            p = prompts[i % len(prompts)]
            reqs[f"b{i}"] = (p, dataclasses.replace(greedy, max_tokens=40 + 9 * i))
        batched[method] = _run(eng, reqs)[0]
        if method != "off":
            assert _accepted(eng) > 0, f"{method}: no draft was accepted; the test would prove nothing"
    for method in ("ngram", "suffix"):
        assert alone[method] == alone["off"], method
        assert batched[method] == batched["off"], method


@pytest.mark.slow
def test_seeded_sampling_with_every_parameter_equal_without_speculation(smol_int4):
    """Row j of a request's drafts draws the random numbers of its output position, and
    penalties and min_tokens see the drafts before it: the same tokens as one at a time."""
    prompts = _prompts(smol_int4)
    variants = [
        SamplingParams(temperature=0.7, seed=11, max_tokens=64),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=12, max_tokens=64),
        SamplingParams(temperature=0.8, min_p=0.05, seed=13, max_tokens=64, frequency_penalty=0.4,
                       presence_penalty=0.3),
        SamplingParams(temperature=0.5, seed=14, max_tokens=64, repetition_penalty=1.2, min_tokens=20,
                       logit_bias={28: 2.0, 30: -5.0}),
        SamplingParams(temperature=0.6, seed=15, max_tokens=48, logprobs=3),
        SamplingParams(temperature=0.9, seed=16, max_tokens=48, n=3),
    ]
    got = {}
    for method in METHODS:
        eng = _engine(smol_int4, method)
        reqs = {f"s{i}-{j}": (p, sp) for i, sp in enumerate(variants) for j, p in enumerate(prompts[:2])}
        got[method] = _run(eng, reqs)[0]
        if method != "off":
            assert _accepted(eng) > 0
    assert got["ngram"] == got["off"]
    assert got["suffix"] == got["off"]


@pytest.mark.slow
def test_logprobs_of_accepted_drafts_equal_without_speculation(smol_int4):
    prompt = _prompts(smol_int4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    outs = {}
    for method in ("off", "ngram"):
        eng = _engine(smol_int4, method)
        eng.add_request("r", prompt, params)
        lps = []
        while eng.has_unfinished():
            for o in eng.step():
                lps += o.logprobs or []
        outs[method] = [(lp.token_id, round(lp.logprob, 4), [t for t, _ in lp.top]) for lp in lps]
        assert len(lps) == 40
        if method == "ngram":
            assert eng.stats().spec_accepted_tokens > 10
    assert outs["ngram"] == outs["off"]


@pytest.mark.slow
def test_stops_inside_an_accepted_run_cut_where_one_at_a_time_decoding_does(smol_int4):
    """Stop token ids, stop strings and max_tokens at every place of an output that
    speculation makes in runs of accepted drafts."""
    prompt = _prompts(smol_int4)[0]
    ref_eng = _engine(smol_int4, "off")
    full = _run(ref_eng, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=80))})[0]["r"][0]
    assert len(full) > 40
    text = smol_int4.tokenizer.decode(full)
    cases = {}
    for i in range(3, min(len(full), 70), 5):
        cases[f"len{i}"] = SamplingParams(temperature=0.0, max_tokens=i)
        cases[f"tok{i}"] = SamplingParams(temperature=0.0, max_tokens=80, stop_token_ids=[full[i]])
    for cut in (len(text) // 5, len(text) // 3, len(text) // 2):
        stop = text[cut:cut + 4]
        if stop.strip():
            cases[f"str{cut}"] = SamplingParams(temperature=0.0, max_tokens=80, stop=[stop])
    results = {}
    for method in ("off", "ngram"):
        eng = _engine(smol_int4, method)
        # one at a time: a lone decode is where drafts pay, so where runs are accepted
        results[method] = [_run(eng, {k: (prompt, sp)})[:2] for k, sp in cases.items()]
        if method == "ngram":
            assert eng.stats().spec_accepted_tokens > 20
    assert results["ngram"] == results["off"]


@pytest.mark.slow
def test_abort_inside_speculation_frees_its_blocks_and_spares_the_others(smol_int4):
    prompts = _prompts(smol_int4)
    params = SamplingParams(temperature=0.0, max_tokens=80)
    ref = _run(_engine(smol_int4, "off"), {"keep": (prompts[1], params)})[0]["keep"]
    eng = _engine(smol_int4, "ngram")
    eng.add_request("keep", prompts[1], params)
    eng.add_request("drop", prompts[0], params)
    got: list[int] = []
    dropped = False
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == "keep":
                got += o.new_token_ids
        eng.kv.check_integrity()
        if not dropped and eng.stats().spec_accepted_tokens > 5:
            dropped = True
            outs = eng.abort("drop")
            assert outs and outs[0].finish_reason == "abort"
    assert dropped
    assert got == ref[0]
    assert eng.kv.num_used_blocks == 0


def test_ngram_proposes_what_followed_the_latest_longest_match():
    prop = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=3))
    st = prop.new_state()
    # "5 6 7" occurs twice before the end; its latest occurrence is followed by 9 10
    prompt = [1, 5, 6, 7, 8, 2, 5, 6, 7, 9, 10, 11, 3]
    st.sync(prompt, [4, 5, 6, 7])
    assert prop.propose(st, None, 3) == [9, 10, 11]
    # only the 2-gram "6 7" matches: falls back to the shorter pattern
    st2 = prop.new_state()
    st2.sync([6, 7, 42, 43, 0, 99, 6, 7], [])
    assert prop.propose(st2, None, 2) == [42, 43]
    st3 = prop.new_state()
    st3.sync([1, 2, 3, 4], [5])
    assert prop.propose(st3, None, 4) == []


def test_suffix_continues_by_frequency_and_never_across_tenants():
    prop = SuffixProposer(SpeculativeConfig(method="suffix", prompt_lookup_min=2, suffix_max_match=4,
                                            suffix_min_prob=0.4))
    a, b = ("tenant-a", None), ("tenant-b", None)
    for out in ([10, 11, 12, 13, 14], [10, 11, 12, 13, 15], [10, 11, 12, 20, 21]):
        prop.finished(prop.new_state(), a, out)
    st = prop.new_state()
    st.sync([1, 2, 3], [10, 11])
    # after "10 11": 12 always (3/3), then 13 (2/3), then 14 or 15 (1/2: score 1/3 < 0.4 stops)
    assert prop.propose(st, a, 5) == [12, 13]
    st_b = prop.new_state()
    st_b.sync([1, 2, 3], [10, 11])
    assert prop.propose(st_b, b, 5) == [], "another tenant's outputs must not be proposed"
    # its own tokens still count
    st_b2 = prop.new_state()
    st_b2.sync([10, 11, 77, 78, 0], [10, 11])
    assert prop.propose(st_b2, b, 2) == [77, 78]


def test_suffix_corpus_keeps_the_newest_tokens_within_its_cap():
    prop = SuffixProposer(SpeculativeConfig(method="suffix", suffix_max_tokens=64))
    key = ("t", None)
    for i in range(40):
        prop.finished(prop.new_state(), key, [1000 + i, 2000 + i, 3000 + i])
    assert prop.corpus_tokens(key) <= 64
    st = prop.new_state()
    st.sync([], [1039, 2039])
    assert prop.propose(st, key, 1) == [3039]  # the newest stays
    st = prop.new_state()
    st.sync([], [1000, 2000])
    assert prop.propose(st, key, 1) == []  # the oldest went


def test_drafts_back_off_when_they_miss_and_under_a_big_batch():
    """A request whose drafts keep missing stops drafting; sixteen decodes draft nothing."""
    loaded = tiny_loaded(vocab=64, seed=3)
    eng = _engine(loaded, "ngram", prompt_lookup_min=1, prompt_lookup_max=2)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # the proposer always has a match
    eng.add_request("r", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=200, ignore_eos=True))
    drafted = []
    while eng.has_unfinished():
        before = eng.stats().spec_draft_tokens
        eng.step()
        drafted.append(eng.stats().spec_draft_tokens - before)
    st = eng.stats()
    rate = st.spec_accepted_tokens / max(st.spec_draft_tokens, 1)
    assert rate < 0.3, "a random model should reject most drafts"
    assert sum(drafted[-100:]) < 25, f"drafting kept on at a low acceptance: {drafted[-100:]}"

    eng = _engine(loaded, "ngram", prompt_lookup_min=1, prompt_lookup_max=2)
    for i in range(16):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    run_to_completion(eng, {})
    assert eng.stats().spec_draft_tokens == 0


def test_rejection_sampling_keeps_the_target_distribution():
    """Many seeded samples with a fixed two-token draft, on a model with a small
    vocabulary. The prefill step makes token 0 (no drafts); the next step checks the
    drafts at output positions 1 and 2. Among samples with the same token 0, token 1 is
    distributed as the model's p1 (the draft accepted with probability p1(x), else a token
    from p1 without x), and token 2, given the first draft was accepted, as p2.
    Chi-square tests at significance 0.001."""
    from tests.helpers import full_logits

    loaded = tiny_loaded(vocab=8, hidden=16, seed=5)
    prompt = [1, 2, 3, 4, 5]
    draft = [3, 6]

    def target(ids: list[int]) -> torch.Tensor:
        return torch.softmax(full_logits(loaded.model, ids)[-1].double(), -1)

    eng = _engine(loaded, "ngram", prompt_lookup_min=1, prompt_lookup_max=1, num_speculative_tokens=2,
                  row_cost=0.01, max_num_seqs=4)
    eng.scheduler.spec.proposer.propose = lambda state, key, k: list(draft[:k])
    N = 4000
    reqs = {f"s{i}": (prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True))
            for i in range(N)}
    tokens = [t[0] for t in run_to_completion(eng, reqs)[0].values()]
    assert eng.stats().spec_verifications >= N * 0.9, "the drafts were not checked"
    c = int(target(prompt).argmax())
    given = [t for t in tokens if t[0] == c]
    assert len(given) > N // 8
    first = torch.tensor([t[1] for t in given])
    second = torch.tensor([t[2] for t in given if t[1] == draft[0]])
    p1 = target(prompt + [c])
    p2 = target(prompt + [c, draft[0]])
    # chi-square critical values at 0.001 for 1..7 degrees of freedom
    critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32]
    for sample, p in ((first, p1), (second, p2)):
        assert len(sample) >= 100
        counts = torch.bincount(sample, minlength=8).double()
        expected = p * len(sample)
        keep = expected >= 5  # cells too small for the test are pooled into one
        obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
        exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
        if exp[-1] < 5:
            obs, exp = obs[:-1], exp[:-1]
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        df = len(obs) - 1
        assert df >= 1
        assert chi2 < critical[df - 1], f"chi2 {chi2:.1f} at {df} degrees of freedom"
    # the first draft is accepted with probability p1(x)
    rate = float((first == draft[0]).double().mean())
    q = float(p1[draft[0]])
    assert abs(rate - q) < 4 * (q * (1 - q) / len(first)) ** 0.5


@pytest.mark.slow
def test_grammar_constrained_requests_equal_without_speculation(smol_int4):
    """Row j's grammar mask is the one after the drafts before it (the matcher advances
    over them and is rolled back): constrained output is the same with drafts."""
    import json

    from tokenmill.engine.api import StructuredOutput

    schema = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "count"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}
    tok = smol_int4.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        "Give this inventory as JSON with a list of items, each with a name and a count: "
        "apples 3, pears 4, plums 5, figs 6, limes 7, kiwis 8.")}]), add_special_tokens=False)
    specs = [SamplingParams(temperature=0.0, max_tokens=120, structured=StructuredOutput("json", schema)),
             SamplingParams(temperature=0.7, seed=3, max_tokens=120, structured=StructuredOutput("json", schema)),
             SamplingParams(temperature=0.0, max_tokens=60,
                            structured=StructuredOutput("regex", r"(apple|pear|plum)( (apple|pear|plum)){3,12}"))]
    got = {}
    for method in ("off", "ngram"):
        eng = _engine(smol_int4, method)
        got[method] = [_run(eng, {"r": (prompt, sp)})[0]["r"][0] for sp in specs]
        if method == "ngram":
            assert eng.stats().spec_accepted_tokens > 5
        assert len(eng.grammar) == 0
    assert got["ngram"] == got["off"]
    json.loads(tok.decode(got["off"][0]))
