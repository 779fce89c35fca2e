"""Text-level behaviour on the embedded model: stop strings, logprobs against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_engine, run_to_completion
from tokenmill.engine.api import SamplingParams


@pytest.fixture(scope="module")
def france(smol):
    tok = smol.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                      add_special_tokens=False)


def test_stop_string_across_token_boundaries(smol, france):
    engine = make_engine(smol, num_blocks=64)
    base_toks, base_text, _ = run_to_completion(engine, {"a": (france, SamplingParams(
        temperature=0, max_tokens=12))})
    text = base_text["a"][0]
    assert text.startswith("The capital of France is Paris")
    tok = smol.tokenizer
    pieces = [tok.decode([t]) for t in base_toks["a"][0]]
    # "l of Fr" starts inside one token ("capital") and ends inside another ("France")
    stop = "l of Fr"
    assert not any(stop in p for p in pieces)
    _, texts, fin = run_to_completion(engine, {"b": (france, SamplingParams(
        temperature=0, max_tokens=12, stop=[stop, "never-appears"]))})
    assert texts["b"][0] == "The capita"
    assert fin["b"][0] == "stop"
    _, texts, _ = run_to_completion(engine, {"c": (france, SamplingParams(
        temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True))})
    assert texts["c"][0] == "The capital of Fr"


def test_stop_string_never_leaks_into_stream(smol, france):
    engine = make_engine(smol, num_blocks=64)
    engine.add_request("s", france, SamplingParams(temperature=0, max_tokens=12, stop=["France is"]))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.text for o in engine.step()]
    streamed = "".join(deltas)
    assert streamed == "The capital of "
    assert all("France" not in d for d in deltas)


@pytest.mark.slow
def test_logprobs_equal_log_softmax_of_reference(smol, hf_smol, france):
    engine = make_engine(smol, num_blocks=64)
    engine.add_request("l", france, SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    toks = [o.new_token_ids[0] for o in outs if o.new_token_ids]
    lps = [o.logprobs[0] for o in outs if o.logprobs]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([france + toks])).logits[0].float(), -1)
    for j, lp in enumerate(lps):
        row = ref[len(france) - 1 + j]
        assert lp.token_id == toks[j]
        assert abs(lp.logprob - row[toks[j]].item()) < 1e-4
        want = torch.topk(row, 5)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(lp.top, want.values.tolist())) < 1e-4


@pytest.mark.slow
def test_prompt_logprobs_match_reference(smol, hf_smol, france):
    engine = make_engine(smol, num_blocks=64, max_num_batched_tokens=10)
    engine.add_request("p", france, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    plp = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    assert len(plp) == len(france) and plp[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([france])).logits[0].float(), -1)
    for i in range(1, len(france)):
        assert plp[i].token_id == france[i]
        assert abs(plp[i].logprob - ref[i - 1, france[i]].item()) < 1e-4
