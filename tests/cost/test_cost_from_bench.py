"""Self-hosted prices from a handmade benchmark results file."""

from __future__ import annotations

import json
from decimal import Decimal as D

import pytest

from tokenmill.cost.from_bench import (METHOD_FALLBACK, METHOD_SPLIT, BenchResultsError, load_runs, parse_runs,
                                       price_run)

RESULTS = {
    "meta": {"url": "http://localhost:8000", "model": "tokenmill-default"},
    "runs": [
        {"label": "c8", "mode": "closed", "concurrency": 8, "request_rate": None, "duration_s": 100.0,
         "num_requests": 200, "num_ok": 200, "num_errors": 0, "input_tokens_total": 100_000,
         "output_tokens_total": 20_000, "output_tokens_per_s": 200.0, "total_tokens_per_s": 1200.0,
         "requests_per_s": 2.0, "ttft_ms": {"p50": 200, "p90": 400, "p95": 450, "p99": 500, "mean": 250.0},
         "itl_ms": {"mean": 39.5}, "e2e_ms": {"p50": 900, "mean": 1000.0}, "extra": {"anything": 1}},
        {"label": "no-latency", "duration_s": 100, "input_tokens_total": 100_000, "output_tokens_total": 20_000},
    ],
}


def test_split_by_ttft_share_reproduces_the_bill(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS))
    split, fallback = (price_run(run, "3.60") for run in load_runs(path))
    # $3.60/h for 100 s = $0.10; prefill share 250/1000 = 0.25
    assert (split.machine_usd, split.prefill_share, split.method) == (D("0.1"), D("0.25"), METHOD_SPLIT)
    assert split.usd_per_mtok_input == D("0.25")  # 0.025 / 100000 x 1e6
    assert split.usd_per_mtok_output == D("3.75")  # 0.075 / 20000 x 1e6
    assert split.usd_per_mtok_output_all == D(5)  # 0.10 / 20000 x 1e6
    assert split.usd_per_request == D("0.0005")
    # the average request (500 in, 100 out) priced at these rates costs the run's cost per request
    assert (500 * split.usd_per_mtok_input + 100 * split.usd_per_mtok_output) / 1_000_000 == split.usd_per_request
    assert fallback.method == METHOD_FALLBACK
    assert (fallback.usd_per_mtok_input, fallback.usd_per_mtok_output) == (0, D(5))
    assert fallback.usd_per_request is None


def test_missing_fields_are_named():
    broken = {"runs": [{"label": "c8", "input_tokens_total": 1, "output_tokens_total": 1}]}
    with pytest.raises(BenchResultsError, match="run 0 \\('c8'\\): missing required field 'duration_s'"):
        parse_runs(broken)
    with pytest.raises(BenchResultsError, match="'runs' must be a non-empty list"):
        parse_runs({"meta": {}, "runs": []})
    with pytest.raises(BenchResultsError, match="'output_tokens_total' must be an integer"):
        parse_runs({"runs": [{"duration_s": 1, "input_tokens_total": 1, "output_tokens_total": 1.5}]})


def test_unreadable_results(tmp_path):
    with pytest.raises(BenchResultsError, match="no such file"):
        load_runs(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(BenchResultsError, match="not JSON"):
        load_runs(bad)
