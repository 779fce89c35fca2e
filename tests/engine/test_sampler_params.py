"""The sampler's parameters tested for what they do: on hand-made logits against a
plain numpy reference (supports by seeded sampling, distributions by chi-square,
penalties as exact logit transforms), and logit_bias end to end through an engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import make_engine, run_to_completion, tiny_loaded
from tokenmill.engine import sampler
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.sampler import LogitBias, SamplingBatch, _apply_penalties, _apply_top_k_top_p_min_p, sample

V = 12
# row 0: these probabilities, shuffled; row 1: flatter; row 2: one token dominates
PROBS0 = np.array([0.06, 0.2, 0.01, 0.12, 0.09, 0.03, 0.15, 0.05, 0.1, 0.04, 0.08, 0.07])
LOGITS = np.array([
    np.log(PROBS0),
    [1.0, -0.5, 2.0, 0.3, -1.2, 1.5, 0.0, -2.0, 0.8, 0.6, -0.8, 1.2],
    [0.5, 0.1, -0.3, 4.0, 0.9, -1.0, 0.2, 1.1, -0.6, 0.4, 2.2, 0.0],
], dtype=np.float32)
N = 4000  # draws per support check: the rarest kept token here has p > 0.005 (~20 expected hits)
CHI2_999 = 31.26  # chi-square, 11 degrees of freedom, 99.9th percentile


# -- the reference: plain numpy over one probability vector ------------------------------
def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def ref_top_k(p: np.ndarray, k: int) -> set[int]:
    assert len(set(p.tolist())) == len(p), "no ties (ties have their own test)"
    return set(np.argsort(-p)[:k].tolist())


def ref_top_p(p: np.ndarray, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p."""
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    assert np.abs(cum - top_p).min() > 1e-3, "top_p on a boundary: the test would be ill-posed"
    n = int(np.searchsorted(cum, top_p)) + 1
    return set(order[:n].tolist())


def ref_min_p(p: np.ndarray, min_p: float) -> set[int]:
    thresh = min_p * p.max()
    assert np.abs(p - thresh).min() > 1e-4, "a token on the min_p threshold: ill-posed"
    return set(np.flatnonzero(p >= thresh).tolist())


def ref_penalties(x: np.ndarray, out_ids: list[int], prompt_ids: list[int], presence: float,
                  frequency: float, repetition: float) -> np.ndarray:
    """vLLM's / HF's repetition penalty over prompt and output tokens, then OpenAI's
    presence and frequency penalties over output token counts."""
    x = x.astype(np.float64).copy()
    counts = np.bincount(np.array(out_ids, dtype=np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[prompt_ids] = True
    for t in np.flatnonzero(seen):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    return x - frequency * counts - presence * (counts > 0)


def chi2(tokens: np.ndarray, p: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=len(p))
    expected = p * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


# -- drawing from the sampler -----------------------------------------------------------
def draw(row: np.ndarray, n: int = N, seed: int = 0, *, temperature: float = 1.0, top_k: int = 0,
         top_p: float = 1.0, min_p: float = 0.0, bias: dict[int, float] | None = None,
         banned: list[int] | None = None) -> np.ndarray:
    """n draws from one row's settings: the row repeated n times, one seed at n positions."""
    logits = torch.from_numpy(np.ascontiguousarray(row, dtype=np.float32)).repeat(n, 1)
    b = SamplingBatch(temperature=torch.full((n,), temperature), all_greedy=temperature == 0.0,
                      seeds=[seed] * n, indices=list(range(n)))
    if top_k:
        b.top_k = torch.full((n,), top_k, dtype=torch.int64)
    if top_p < 1.0:
        b.top_p = torch.full((n,), top_p)
    if min_p > 0.0:
        b.min_p = torch.full((n,), min_p)
    if bias:
        b.logit_bias = LogitBias.from_maps([bias] * n)
    if banned:
        b.banned = [(i, banned) for i in range(n)]
    return np.array(sample(logits, b).token_ids)


def support(tokens: np.ndarray) -> set[int]:
    return set(np.unique(tokens).tolist())


def greedy_batch(**kw) -> SamplingBatch:
    return SamplingBatch(temperature=torch.zeros(0), all_greedy=True, **kw)


# -- top-k / top-p / min-p --------------------------------------------------------------
@pytest.mark.parametrize("row", range(len(LOGITS)))
@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_the_k_largest(row, k):
    got = support(draw(LOGITS[row], top_k=k, seed=row * 10 + k))
    assert got == ref_top_k(softmax(LOGITS[row]), k)


def test_top_k_at_least_the_vocabulary_or_zero_keeps_everything():
    assert support(draw(LOGITS[1], top_k=V)) == set(range(V))
    assert support(draw(LOGITS[1], top_k=V + 5)) == set(range(V))
    off = torch.zeros(1, dtype=torch.int64)
    assert torch.equal(_apply_top_k_top_p_min_p(torch.from_numpy(LOGITS[1:2]), off, None, None),
                       torch.from_numpy(LOGITS[1:2]))


def test_top_k_keeps_every_token_tied_with_the_kth():
    # documented: the k-th largest logit is the threshold, so a tie there keeps them all
    row = np.array([3.0, 2.0, 2.0, 1.0, 0.0, 2.5], dtype=np.float32)
    assert support(draw(row, top_k=2)) == {0, 5}
    assert support(draw(row, top_k=3)) == {0, 5, 1, 2}


@pytest.mark.parametrize("row", range(len(LOGITS)))
@pytest.mark.parametrize("top_p", [0.3, 0.55, 0.8, 0.95])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(row, top_p):
    got = support(draw(LOGITS[row], top_p=top_p, seed=row))
    assert got == ref_top_p(softmax(LOGITS[row]), top_p)


def test_top_p_applies_to_the_tempered_distribution():
    p_cold = softmax(LOGITS[1] / 0.5)
    want = ref_top_p(p_cold, 0.8)
    assert want != ref_top_p(softmax(LOGITS[1]), 0.8)  # the temperature matters here
    assert support(draw(LOGITS[1], temperature=0.5, top_p=0.8)) == want


def test_top_p_after_top_k_is_over_the_renormalized_survivors():
    p = softmax(LOGITS[0])
    k5 = sorted(ref_top_k(p, 5))
    renorm = np.zeros(V)
    renorm[k5] = p[k5] / p[k5].sum()
    want = ref_top_p(renorm, 0.6)
    assert support(draw(LOGITS[0], top_k=5, top_p=0.6)) == want


def test_top_p_of_one_truncates_nothing_even_beside_a_row_that_truncates():
    # a peaked row: the rounded cumulative sum reaches 1 long before the tail
    logits = torch.zeros(2, 1000)
    logits[:, 0], logits[:, 1] = 20.0, 19.0
    out = _apply_top_k_top_p_min_p(logits, None, torch.tensor([1.0, 0.5]), None)
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).sum() == 1
    got = sampler.draw(logits, torch.ones(2), [3, 3], [0, 0], None, torch.tensor([1.0, 0.5]), None)
    assert int(got[1]) == 0


@pytest.mark.parametrize("row", range(len(LOGITS)))
@pytest.mark.parametrize("min_p", [0.07, 0.27, 0.52])
def test_min_p_keeps_tokens_within_a_factor_of_the_top(row, min_p):
    got = support(draw(LOGITS[row], min_p=min_p, seed=row + 3))
    assert got == ref_min_p(softmax(LOGITS[row]), min_p)


# -- temperature ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_logits_over_t(temperature):
    tokens = draw(LOGITS[0], n=20000, seed=7, temperature=temperature)
    assert chi2(tokens, softmax(LOGITS[0] / temperature)) < CHI2_999
    # the check has power: the distribution at another temperature is far off
    other = 1.0 if temperature != 1.0 else 2.0
    assert chi2(tokens, softmax(LOGITS[0] / other)) > 10 * CHI2_999


def test_temperature_zero_rows_take_the_argmax_in_a_sampled_batch():
    logits = torch.from_numpy(LOGITS)
    b = SamplingBatch(temperature=torch.tensor([0.0, 1.0, 0.0]), all_greedy=False,
                      top_k=torch.tensor([0, 2, 2]), seeds=[1] * 3, indices=[0, 0, 0])
    for i in range(50):
        b.indices = [i] * 3
        out = sample(logits, b).token_ids
        assert out[0] == int(np.argmax(LOGITS[0])) and out[2] == int(np.argmax(LOGITS[2]))


# -- penalties --------------------------------------------------------------------------
PEN_ROWS = [  # (presence, frequency, repetition, output ids, prompt ids)
    (0.5, 0.3, 1.0, [3, 3, 5], [1]),
    (0.0, 0.0, 1.3, [2, 7], [0, 7, 9]),
    (0.4, 0.2, 1.5, [4, 4, 4, 11], [6, 1]),
    (0.0, 0.0, 1.0, [1, 2], []),
    (-0.7, -0.4, 0.8, [0, 10, 10], [8]),
]


def test_penalties_are_the_reference_logit_transform():
    rows = np.stack([LOGITS[0], LOGITS[1], LOGITS[2], LOGITS[1], LOGITS[2]])
    rows[:, 1] = [-0.9, 0.7, -0.3, 0.2, -2.0]  # negative and positive logits among the seen tokens
    b = SamplingBatch(temperature=torch.ones(len(rows)), all_greedy=False,
                      presence=torch.tensor([r[0] for r in PEN_ROWS]),
                      frequency=torch.tensor([r[1] for r in PEN_ROWS]),
                      repetition=torch.tensor([r[2] for r in PEN_ROWS]),
                      output_ids=[r[3] for r in PEN_ROWS], prompt_ids=[r[4] for r in PEN_ROWS])
    got = _apply_penalties(torch.from_numpy(rows), b).numpy()
    want = np.stack([ref_penalties(rows[i], *PEN_ROWS[i][3:], *PEN_ROWS[i][:3]) for i in range(len(rows))])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(got[3], rows[3])  # a row without penalties is left exactly as it was
    assert not np.allclose(got[:3], rows[:3])


def _greedy_pen(logits, presence=0.0, frequency=0.0, repetition=1.0, out=(), prompt=()):
    b = greedy_batch(presence=torch.tensor([presence]), frequency=torch.tensor([frequency]),
                     repetition=torch.tensor([repetition]), output_ids=[list(out)], prompt_ids=[list(prompt)])
    return sample(torch.tensor([logits]), b).token_ids[0]


def test_presence_penalty_flips_the_greedy_choice():
    assert _greedy_pen([2.0, 1.8, 0.0], presence=0.1, out=[0]) == 0
    assert _greedy_pen([2.0, 1.8, 0.0], presence=0.5, out=[0]) == 1
    assert _greedy_pen([2.0, 1.8, 0.0], presence=0.5, out=[0, 0, 0]) == 1  # not per count
    assert _greedy_pen([2.0, 1.8, 0.0], presence=-0.5, out=[1]) == 1  # negative encourages


def test_frequency_penalty_scales_with_the_count():
    assert _greedy_pen([2.0, 1.8, 0.0], frequency=0.1, out=[0]) == 0
    assert _greedy_pen([2.0, 1.8, 0.0], frequency=0.1, out=[0, 2, 0, 0]) == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    assert _greedy_pen([2.0, 1.8], repetition=1.2, out=[0]) == 1  # 2 / 1.2 < 1.8
    assert _greedy_pen([-1.0, -1.1], repetition=1.2, out=[0]) == 1  # -1 * 1.2 < -1.1
    assert _greedy_pen([-1.0, -1.1], repetition=1.05, out=[0]) == 0  # -1.05 > -1.1
    # prompt tokens count as seen; counts don't matter
    assert _greedy_pen([2.0, 1.8], repetition=1.2, prompt=[0]) == 1
    assert _greedy_pen([2.0, 1.5], repetition=1.2, out=[0, 0, 0, 0]) == 0  # 1.67 > 1.5


def test_penalties_ignore_a_given_stale_argmax():
    b = greedy_batch(presence=torch.tensor([0.5]), frequency=torch.zeros(1), repetition=torch.ones(1),
                     output_ids=[[0]], prompt_ids=[[]])
    assert sample(torch.tensor([[2.0, 1.8]]), b, torch.tensor([0])).token_ids == [1]


# -- logit_bias -------------------------------------------------------------------------
def test_logit_bias_tensors_are_flat_row_token_value_triples():
    lb = LogitBias.from_maps([None, {3: 1.5, 7: -100.0}, {}, {0: 100}])
    assert lb.rows.tolist() == [1, 1, 3] and lb.token_ids.tolist() == [3, 7, 0]
    assert lb.values.tolist() == [1.5, -100.0, 100.0]
    assert lb.rows.dtype == lb.token_ids.dtype == torch.int64 and lb.values.dtype == torch.float32


def test_logit_bias_flips_the_greedy_choice_and_ignores_a_stale_argmax():
    logits = torch.from_numpy(LOGITS)
    top = LOGITS.argmax(1).tolist()
    b = greedy_batch(logit_bias=LogitBias.from_maps([{5: 5.0}, None, {top[2]: -3.0}]))
    got = sample(logits, b, torch.tensor(top)).token_ids
    assert got[0] == 5 and got[1] == top[1]
    assert got[2] == int(np.argsort(-LOGITS[2])[1])  # the runner-up: 4.0 - 3 < 2.2


def test_logit_bias_applies_in_greedy_rows_of_a_sampled_batch():
    logits = torch.from_numpy(LOGITS[:2])
    b = SamplingBatch(temperature=torch.tensor([0.0, 1.0]), all_greedy=False,
                      logit_bias=LogitBias.from_maps([{2: 10.0}, None]))
    assert sample(logits, b).token_ids[0] == 2


def test_minus_100_bans_a_token_under_sampling():
    p = softmax(LOGITS[2])
    top = int(p.argmax())
    assert p[top] > 0.5
    got = draw(LOGITS[2], temperature=1.5, bias={top: -100.0})
    assert top not in support(got)
    assert support(got) == set(range(V)) - {top}


def test_plus_100_forces_a_token_under_sampling():
    rare = int(np.argmin(PROBS0))
    got = draw(LOGITS[0], temperature=2.0, top_p=0.9, bias={rare: 100.0})
    assert support(got) == {rare}


def test_logit_bias_is_added_before_temperature():
    bias = {2: 1.5, 6: -1.0, 9: 0.8}
    t = 0.5
    tokens = draw(LOGITS[0], n=20000, seed=3, temperature=t, bias=bias)
    biased = LOGITS[0].astype(np.float64).copy()
    for tok, v in bias.items():
        biased[tok] += v
    assert chi2(tokens, softmax(biased / t)) < CHI2_999
    after = np.log(softmax(LOGITS[0] / t))  # the bias added after the temperature instead
    for tok, v in bias.items():
        after[tok] += v
    assert chi2(tokens, softmax(after)) > 10 * CHI2_999


def test_logit_bias_comes_before_penalties():
    # token 1 seen, repetition 2, bias +2: (2 + 2) / 2 = 2.0 < 2.5; penalty first would be 3.0
    b = greedy_batch(logit_bias=LogitBias.from_maps([{1: 2.0}]), presence=torch.zeros(1),
                     frequency=torch.zeros(1), repetition=torch.tensor([2.0]), output_ids=[[1]], prompt_ids=[[]])
    assert sample(torch.tensor([[2.5, 2.0, 0.0]]), b).token_ids == [0]


def test_logit_bias_cannot_lift_a_stop_token_banned_by_min_tokens():
    b = greedy_batch(banned=[(0, [4])], logit_bias=LogitBias.from_maps([{4: 100.0}]))
    assert sample(torch.from_numpy(LOGITS[:1]), b).token_ids == [int(np.argmax(LOGITS[0]))]
    assert 4 not in support(draw(LOGITS[0], bias={4: 100.0}, banned=[4]))


def test_logprobs_are_of_the_raw_distribution_despite_bias():
    logits = torch.from_numpy(LOGITS)
    b = greedy_batch(logit_bias=LogitBias.from_maps([{5: 50.0}, None, None]), num_logprobs=2)
    out = sample(logits, b)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids[0] == 5
    assert out.logprobs[0] == pytest.approx(float(raw[0, 5]))
    assert out.top_ids[0] == torch.topk(raw[0], 2).indices.tolist()


# -- min_tokens -------------------------------------------------------------------------
def test_banned_stop_tokens_are_never_chosen_and_the_rest_keep_their_odds():
    stop = [1, 6]  # the two most likely tokens of row 0
    tokens = draw(LOGITS[0], n=20000, seed=11, banned=stop)
    assert support(tokens).isdisjoint(stop)
    masked = LOGITS[0].astype(np.float64).copy()
    masked[stop] = -np.inf
    p = softmax(masked)
    keep = p > 0
    observed = np.bincount(tokens, minlength=V)[keep]
    expected = p[keep] * len(tokens)
    assert float(((observed - expected) ** 2 / expected).sum()) < 29.59  # 9 dof, 99.9th pct


def test_banned_applies_to_its_row_only():
    logits = torch.from_numpy(LOGITS)
    top = LOGITS.argmax(1).tolist()
    out = sample(logits, greedy_batch(banned=[(1, [top[1]])]), torch.tensor(top)).token_ids
    assert out[0] == top[0] and out[2] == top[2]
    assert out[1] == int(np.argsort(-LOGITS[1])[1])


# -- rows with different settings in one batch ------------------------------------------
MIXED = [  # one row's settings each; "pen": (presence, frequency, repetition, output, prompt)
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=3),
    dict(temperature=1.2, top_p=0.6),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=1.0, pen=(0.5, 0.2, 1.0, [0, 0, 3], [])),
    dict(temperature=0.7, bias={4: 2.0, 9: -100.0}),
    dict(temperature=1.0, banned=[2, 3]),
    dict(temperature=1.3, top_k=6, top_p=0.85, min_p=0.05, pen=(0.0, 0.0, 1.4, [5], [7, 8]), bias={11: 1.0}),
    dict(temperature=0.0, bias={0: 3.0}, pen=(0.3, 0.0, 1.0, [1], [])),
]


def _mixed_batch(specs: list[dict], seeds: list[int], index: int) -> SamplingBatch:
    """A batch as the runner builds it: a field only when some row uses it."""
    n = len(specs)
    temps = [s.get("temperature", 1.0) for s in specs]
    b = SamplingBatch(temperature=torch.tensor(temps), all_greedy=all(t == 0.0 for t in temps),
                      seeds=seeds, indices=[index] * n)
    if any(s.get("top_k") for s in specs):
        b.top_k = torch.tensor([s.get("top_k", 0) for s in specs])
    if any("top_p" in s for s in specs):
        b.top_p = torch.tensor([s.get("top_p", 1.0) for s in specs])
    if any("min_p" in s for s in specs):
        b.min_p = torch.tensor([s.get("min_p", 0.0) for s in specs])
    if any("pen" in s for s in specs):
        pens = [s.get("pen", (0.0, 0.0, 1.0, [], [])) for s in specs]
        b.presence, b.frequency, b.repetition = (torch.tensor([p[i] for p in pens]) for i in range(3))
        b.output_ids, b.prompt_ids = [p[3] for p in pens], [p[4] for p in pens]
    if any("bias" in s for s in specs):
        b.logit_bias = LogitBias.from_maps([s.get("bias") for s in specs])
    banned = [(i, s["banned"]) for i, s in enumerate(specs) if "banned" in s]
    b.banned = banned or None
    assert len(seeds) == n
    return b


def test_rows_with_different_settings_do_not_affect_each_other():
    g = torch.Generator().manual_seed(2024)
    logits = torch.randn(len(MIXED), V, generator=g) * 1.5  # fixed, hand-picked settings above
    steps = 60
    seeds = [100 + i for i in range(len(MIXED))]
    batched = [sample(logits, _mixed_batch(MIXED, seeds, t)).token_ids for t in range(steps)]
    for i, spec in enumerate(MIXED):
        alone = [sample(logits[i:i + 1], _mixed_batch([spec], [100 + i], t)).token_ids[0] for t in range(steps)]
        assert [row[i] for row in batched] == alone, f"row {i}: {spec}"
    # the rows really sample (not a degenerate check), and their settings show
    cols = list(zip(*batched))
    assert all(len(set(cols[i])) > 1 for i, s in enumerate(MIXED) if s["temperature"] > 0)
    assert len(set(cols[1])) <= 3 and set(cols[6]).isdisjoint({2, 3}) and 9 not in cols[5]
    assert set(cols[8]) == {0} and len(set(cols[0])) == 1


# -- end to end: logit_bias through an engine -------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded()


def _prompt(n):
    return [(3 + 11 * i) % 290 + 5 for i in range(n)]


def test_logit_bias_through_the_engine(tiny):
    def run(params):
        out, _, _ = run_to_completion(make_engine(tiny), {"r": (_prompt(20), params)})
        return out["r"][0]

    plain = run(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    forced = 123 if 123 not in plain else 124
    assert run(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={forced: 100})) \
        == [forced] * 12
    assert run(SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                              logit_bias={forced: 100.0})) == [forced] * 12
    # ban the token greedy decoding picks most: it never appears, greedy or sampled
    common = max(set(plain), key=plain.count)
    for params in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={common: -100}),
                   SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True,
                                  logit_bias={common: -100.0})):
        got = run(params)
        assert len(got) == params.max_tokens and common not in got
    # a biased request beside an unbiased one: the unbiased one is unchanged
    both, _, _ = run_to_completion(make_engine(tiny), {
        "a": (_prompt(20), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        "b": (_prompt(25), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={forced: 100})),
    })
    assert both["a"][0] == plain and both["b"][0] == [forced] * 12


def test_the_torch_draw_is_the_native_draw(monkeypatch):
    """Machines without the native build draw by the same definition in torch: the same
    token but for float-sum rounding at a boundary (rare)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(400, 300, generator=g) * 2.0
    logits[:, 5] = float("-inf")  # a masked token
    temps = torch.rand(400, generator=g) + 0.3
    seeds = list(range(400))
    indices = [3] * 400
    # truncated rows too: top-k, top-p and min-p, each off in some rows
    top_k = torch.where(torch.arange(400) % 3 == 0, 0, torch.randint(1, 60, (400,), generator=g))
    top_p = torch.where(torch.arange(400) % 4 == 0, 1.0, torch.rand(400, generator=g) * 0.9 + 0.05)
    min_p = torch.where(torch.arange(400) % 5 == 0, torch.rand(400, generator=g) * 0.2, 0.0)
    truncs = (top_k, top_p, min_p)
    native = (sampler.draw(logits, temps, seeds, indices), sampler.draw(logits, temps, seeds, indices, *truncs)) \
        if sampler.native_ops() is not None else None
    monkeypatch.setattr(sampler, "native_ops", lambda: None)
    fallback = sampler.draw(logits, temps, seeds, indices)
    assert fallback.dtype == torch.int64 and not (fallback == 5).any()
    assert len(set(fallback.tolist())) > 50  # really spread over the vocabulary
    truncated = sampler.draw(logits, temps, seeds, indices, *truncs)
    assert not (truncated == fallback).all()  # the truncation did something
    if native is not None:
        assert (native[0] == fallback).float().mean() >= 0.99
        assert (native[1] == truncated).float().mean() >= 0.99


def test_top_p_over_a_large_vocabulary_sorts_only_where_the_nucleus_needs_it():
    """Qwen's 151,936 tokens: the candidates decide a peaked row; a flat one (its nucleus
    past the candidates) is sorted whole; both equal the reference, alone or batched."""
    from tokenmill.engine.sampler import TOP_P_CANDIDATES, _apply_top_p

    rng = np.random.default_rng(7)
    big = 151_936
    peaked = rng.normal(0, 1, big).astype(np.float32)
    peaked[rng.choice(big, 40, replace=False)] += 14.0  # most of the mass in a few dozen tokens
    flat = rng.normal(0, 1, big).astype(np.float32)
    flat[rng.choice(big, 3000, replace=False)] += 10.0  # a nucleus of a thousand-odd tokens
    rows = np.stack([peaked, flat, peaked * 0.7])
    tops, want = [], []
    for row, size in zip(rows, (20, 1200, 35)):  # top_p halfway through the size-th token's mass:
        q = np.exp(row.astype(np.float64) - row.max())  # well inside, however tiny the tail
        q /= q.sum()
        order = np.argsort(-q)
        cum = np.cumsum(q[order])
        tops.append(float((cum[size - 2] + cum[size - 1]) / 2))
        want.append(set(order[:size].tolist()))
    assert len(want[0]) < TOP_P_CANDIDATES < len(want[1])  # both paths are exercised
    together = _apply_top_p(torch.from_numpy(rows), torch.tensor(tops))
    for i in range(3):
        alone = _apply_top_p(torch.from_numpy(rows[i:i + 1]), torch.tensor(tops[i:i + 1]))
        assert torch.equal(alone[0], together[i])  # the batch does not change a row
        assert set(torch.isfinite(together[i]).nonzero().squeeze(1).tolist()) == want[i]
        kept = torch.isfinite(together[i])
        assert torch.equal(together[i][kept], torch.from_numpy(rows[i])[kept])  # kept logits are untouched


def test_native_truncation_over_a_large_vocabulary():
    """The native draw's truncation (what the sampler and the decode bursts run) on Qwen's
    151,936 tokens: top-p's radix select finds the reference nucleus of a peaked row and of
    a flat one (thousands of tokens), at a temperature; top-k keeps the k largest and their
    ties; min-p keeps tokens within a factor of the top; combined, each applies in turn."""
    ops = sampler.native_ops()
    if ops is None:
        pytest.skip("no native build")
    rng = np.random.default_rng(11)
    big = 151_936
    peaked = rng.normal(0, 1, big).astype(np.float32)
    peaked[rng.choice(big, 40, replace=False)] += 14.0
    flat = rng.normal(0, 1, big).astype(np.float32)
    flat[rng.choice(big, 3000, replace=False)] += 10.0
    for row, size, temp in ((peaked, 20, 1.0), (flat, 1200, 1.0), (flat, 900, 1.3), (peaked, 1, 0.7)):
        q = np.exp((row.astype(np.float64) - row.max()) / temp)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        cum = np.cumsum(q[order])
        top_p = float((cum[size - 2] + cum[size - 1]) / 2) if size > 1 else float(cum[0] / 2)
        kept = ops.truncation_kept(torch.from_numpy(row), temp, 0, top_p, 0.0)
        assert set(kept.nonzero().squeeze(1).tolist()) == set(order[:size].tolist()), (size, temp)
    # top-k, ties at the k-th kept
    row = flat.copy()
    order = np.argsort(-row, kind="stable")
    row[order[50]] = row[order[49]]
    kept = ops.truncation_kept(torch.from_numpy(row), 1.0, 50, 1.0, 0.0)
    assert set(kept.nonzero().squeeze(1).tolist()) == set(order[:51].tolist())
    # min-p: within a factor of the top, at the temperature
    q = np.exp((peaked.astype(np.float64) - peaked.max()) / 0.8)
    kept = ops.truncation_kept(torch.from_numpy(peaked), 0.8, 0, 1.0, 0.01)
    want = q >= 0.01
    assert np.abs(q - 0.01).min() > 1e-6 and np.array_equal(kept.numpy(), want)
    # top-k 30, then top-p over the survivors' renormalized mass, then min-p
    q = np.exp(flat.astype(np.float64) - flat.max())
    k30 = np.argsort(-flat, kind="stable")[:30]
    cum = np.cumsum(q[k30]) / q[k30].sum()
    top_p = float((cum[17] + cum[18]) / 2)  # 19 tokens
    min_p = float(q[k30[12]] / q[k30[0]]) * 1.0001  # drops the 13th on
    kept = ops.truncation_kept(torch.from_numpy(flat), 1.0, 30, top_p, min_p)
    assert set(kept.nonzero().squeeze(1).tolist()) == set(k30[:12].tolist())
    # any top_p keeps the top token
    assert ops.truncation_kept(torch.from_numpy(flat), 1.0, 0, 0.0, 0.0).nonzero().squeeze(1).tolist() == [k30[0]]
