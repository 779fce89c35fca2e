"""sample() given the rows' argmax by its caller (the fused decode step computes it)."""

from __future__ import annotations

import torch

from tokenmill.engine.sampler import SamplingBatch, sample


def _batch(**kw) -> SamplingBatch:
    return SamplingBatch(temperature=torch.zeros(0), all_greedy=True, **kw)


def test_given_argmax_is_used_for_greedy_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 5.0]])
    assert sample(logits, _batch()).token_ids == [1, 2]
    # taken as given (the caller computed it from the same logits)
    assert sample(logits, _batch(), torch.tensor([1, 2])).token_ids == [1, 2]
    out = sample(logits, _batch(num_logprobs=1), torch.tensor([1, 2]))
    assert out.token_ids == [1, 2] and out.top_ids == [[1], [2]]
    assert out.logprobs == torch.log_softmax(logits, -1)[[0, 1], [1, 2]].tolist()


def test_given_argmax_is_ignored_when_masking_or_penalties_change_the_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 5.0]])
    stale = torch.tensor([1, 2])
    # row 0 may not stop yet and token 1 is its stop token: the next best is taken
    assert sample(logits, _batch(banned=[(0, [1])]), stale).token_ids == [2, 2]
    pen = _batch(presence=torch.tensor([10.0, 10.0]), frequency=torch.zeros(2), repetition=torch.ones(2),
                 output_ids=[[1], [2]], prompt_ids=[[], []])
    assert sample(logits, pen, stale).token_ids == [2, 0]
