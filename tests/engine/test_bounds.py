"""RequestLimits.resolve: every bound of a request, in one place, before any work."""

from __future__ import annotations

import math

import pytest

from tokenmill.engine.api import (AdmissionError, InvalidParameter, RequestBounds, RequestLimits,
                                  SamplingParams)

VOCAB = 1000
LIMITS = RequestLimits(max_model_len=256, cache_tokens=1024, vocab_size=VOCAB)


def refused(params: SamplingParams, prompts=((1, 2, 3),), limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(InvalidParameter) as ei:
        limits.resolve([list(p) for p in prompts], params)
    return ei.value.param


@pytest.mark.parametrize("kwargs,param", [
    (dict(n=0), "n"), (dict(n=17), "n"), (dict(n=2742889496863), "n"), (dict(n=2.5), "n"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=2 ** 70), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-math.inf), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=math.nan), "repetition_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2 ** 80), "max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(seed=2 ** 64), "seed"), (dict(seed=-(2 ** 63) - 1), "seed"),
    (dict(stop=["x"] * 17), "stop"), (dict(stop=["x" * 257]), "stop"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(65))), "stop_token_ids"),
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={5: math.nan}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
])
def test_each_bound_names_its_parameter(kwargs, param):
    assert refused(SamplingParams(**kwargs)) == param


def test_prompt_token_ids_must_be_in_the_vocabulary():
    assert refused(SamplingParams(), prompts=[(1, VOCAB)]) == "prompt"
    assert refused(SamplingParams(), prompts=[(-1, 2)]) == "prompt"
    assert refused(SamplingParams(), prompts=[(2 ** 31 + 5,)]) == "prompt"
    assert refused(SamplingParams(), prompts=[()]) == "prompt"
    assert refused(SamplingParams(), prompts=[]) == "prompt"
    assert refused(SamplingParams(), prompts=[(1,)] * 65) == "prompt"


def test_context_and_cache_bounds():
    with pytest.raises(AdmissionError, match="maximum context length is 256"):
        LIMITS.resolve([[1] * 200], SamplingParams(max_tokens=100))
    small_cache = RequestLimits(max_model_len=256, cache_tokens=64, vocab_size=VOCAB)
    with pytest.raises(AdmissionError, match="whole KV cache"):
        small_cache.resolve([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(AdmissionError, match="prompt has 256 tokens"):
        LIMITS.resolve([[1] * 256], SamplingParams(max_tokens=None))


def test_check_resolves_max_tokens_and_keeps_the_rest():
    p = SamplingParams(max_tokens=None, temperature=0.5, seed=7, logit_bias={3: -100.0})
    out = LIMITS.resolve([[1] * 56, [2] * 6], p)
    assert out.max_tokens == 200  # room left beside the longest prompt
    assert (out.temperature, out.seed, out.logit_bias) == (0.5, 7, {3: -100.0})
    assert p.max_tokens is None  # the caller's params are not changed
    assert LIMITS.resolve([[1]], SamplingParams(max_tokens=5)).max_tokens == 5


def test_bounds_are_configurable():
    wide = RequestLimits(256, 1024, VOCAB, RequestBounds(max_n=64, max_stop=100))
    assert wide.resolve([[1]], SamplingParams(n=64, stop=["a"] * 100)).n == 64
    with pytest.raises(ValueError):
        RequestBounds(max_n=0)


def test_tiny_sampling_values_do_not_turn_into_nan():
    """Values the bounds allow but fp32 cannot divide by: a temperature below GREEDY_BELOW
    is greedy, a top_p that rounds to 0 keeps the top token, a tiny repetition penalty
    stays finite; every row samples its argmax, not token 0 from a NaN distribution."""
    import torch

    from tokenmill.engine.api import GREEDY_BELOW
    from tokenmill.engine.sampler import SamplingBatch, sample

    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]] * 3)
    tiny = LIMITS.resolve([[1]], SamplingParams(temperature=1e-40))
    assert tiny.greedy and not LIMITS.resolve([[1]], SamplingParams(temperature=GREEDY_BELOW)).greedy
    b = SamplingBatch(temperature=torch.tensor([tiny.temperature, 1.0, 1.0]), all_greedy=False,
                      top_p=torch.tensor([1.0, 5e-324, 1.0]),
                      presence=torch.zeros(3), frequency=torch.zeros(3),
                      repetition=torch.tensor([1.0, 1.0, 1e-38]), output_ids=[[], [], []],
                      prompt_ids=[[], [], [2]])
    b.seeds = [0, 1, 2]
    for i in range(20):
        b.indices = [i] * 3
        assert sample(logits, b).token_ids == [1, 1, 2]  # row 3: token 2 divided by the tiny penalty
