"""Workloads are reproducible from a seed and shaped as asked."""

from __future__ import annotations

import json
import statistics

import pytest

from tokenmill.bench.workload import (LengthDist, WorkloadConfig, WORDS, build_requests, poisson_arrivals,
                                      synthetic_requests)


def test_same_seed_same_requests_other_seed_other_requests():
    cfg = WorkloadConfig(input_len=LengthDist(50, "uniform", 0.5), output_len=LengthDist(20, "normal"), seed=3)
    a, b = build_requests(cfg, 20), build_requests(cfg, 20)
    assert a == b
    c = build_requests(WorkloadConfig(input_len=cfg.input_len, output_len=cfg.output_len, seed=4), 20)
    assert [r.prompt for r in a] != [r.prompt for r in c]
    # a longer run starts with the same requests as a shorter one
    assert build_requests(cfg, 30)[:20] == a
    # every run of a sweep gets its own prompts (no cache reuse across runs), reproducibly
    run1 = build_requests(cfg, 20, run_index=1)
    assert run1 == build_requests(cfg, 20, run_index=1)
    assert not {r.prompt for r in run1} & {r.prompt for r in a}


def test_shared_prefix_is_shared_across_runs_too():
    cfg = WorkloadConfig(input_len=LengthDist(50), shared_prefix=0.5, seed=2)
    a, b = build_requests(cfg, 3, run_index=0), build_requests(cfg, 3, run_index=1)
    assert {tuple(r.prompt.split()[:25]) for r in a + b} == {tuple(a[0].prompt.split()[:25])}


def test_synthetic_prompt_word_count_is_the_input_length():
    reqs = synthetic_requests(WorkloadConfig(input_len=LengthDist(64), output_len=LengthDist(7)), 5)
    assert all(len(r.prompt.split()) == 64 and r.input_len == 64 and r.max_tokens == 7 for r in reqs)
    assert all(w in WORDS for r in reqs for w in r.prompt.split())


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_length_distributions(kind):
    import random

    d = LengthDist(100, kind, 0.2)  # type: ignore[arg-type]
    rng = random.Random(0)
    xs = [d.draw(rng) for _ in range(4000)]
    assert abs(statistics.mean(xs) - 100) < 2
    if kind == "uniform":
        assert min(xs) == 80 and max(xs) == 120
        assert abs(statistics.pstdev(xs) - 40 / 12 ** 0.5) < 1
    else:
        assert abs(statistics.pstdev(xs) - 20) < 1.5
    assert LengthDist(5, "normal", 1.0).draw(rng) >= 1


def test_shared_prefix_fraction():
    cfg = WorkloadConfig(input_len=LengthDist(100), shared_prefix=0.4, seed=1)
    reqs = [r.prompt.split() for r in synthetic_requests(cfg, 6)]
    assert all(r[:40] == reqs[0][:40] for r in reqs)
    # past the prefix the prompts differ (40 random words colliding is impossible in practice)
    assert len({tuple(r[40:]) for r in reqs}) == 6
    none = [r.prompt.split() for r in synthetic_requests(WorkloadConfig(input_len=LengthDist(100)), 6)]
    assert len({tuple(r[:10]) for r in none}) == 6


def test_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hello there", "max_tokens": 5}, {"text": "plain text"},
            {"messages": [{"role": "user", "content": "hi"}], "output_len": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = build_requests(WorkloadConfig(prompts_file=path, output_len=LengthDist(11)), 5)
    assert [r.prompt for r in reqs] == ["hello there", "plain text", "hi", "hello there", "plain text"]
    assert [r.max_tokens for r in reqs] == [5, 11, 9, 5, 11]
    assert reqs[2].messages == [{"role": "user", "content": "hi"}]
    path.write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match="needs 'prompt'"):
        build_requests(WorkloadConfig(prompts_file=path), 1)


def test_poisson_arrivals_are_seeded_with_the_right_rate():
    a = poisson_arrivals(4.0, 4000, seed=1)
    assert a == poisson_arrivals(4.0, 4000, seed=1) and a != poisson_arrivals(4.0, 4000, seed=2)
    gaps = [b - a_ for a_, b in zip(a, a[1:])]
    assert a[0] == 0.0 and all(g >= 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 0.25) < 0.015
    # exponential: the standard deviation equals the mean
    assert abs(statistics.pstdev(gaps) - 0.25) < 0.02


def test_bad_workload_values_are_rejected():
    with pytest.raises(ValueError):
        LengthDist(0)
    with pytest.raises(ValueError):
        LengthDist(10, "zipf")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        WorkloadConfig(shared_prefix=1.5)
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, 0)
