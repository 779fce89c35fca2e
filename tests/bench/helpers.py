"""Helpers for the harness tests: run a benchmark against a fake server in one call."""

from __future__ import annotations

from typing import Any, Optional

from tokenmill.bench.client import ClientConfig
from tokenmill.bench.harness import BenchConfig, run_benchmark
from tokenmill.bench.runner import RunSpec
from tokenmill.bench.stats import Slo
from tokenmill.bench.workload import LengthDist, WorkloadConfig


def bench_once(base_url: str, runs: list[RunSpec], output_len: int = 10, input_len: int = 8,
               slo: Optional[Slo] = None, endpoint: str = "completions", seed: int = 0,
               request_timeout_s: float = 30.0, warmup: int = 1) -> dict[str, Any]:
    """A whole benchmark against `base_url`; returns the results dict. One warm-up request
    (as the CLI sends by default) pays the one-time client set-up (httpcore imports its
    async backend lazily, ~100 ms) outside the measurement."""
    cfg = BenchConfig(
        client=ClientConfig(base_url=base_url, model="fake-model", endpoint=endpoint,  # type: ignore[arg-type]
                            request_timeout_s=request_timeout_s),
        workload=WorkloadConfig(input_len=LengthDist(input_len), output_len=LengthDist(output_len), seed=seed),
        runs=tuple(runs), slo=slo or Slo(), warmup=warmup, command="test")
    return run_benchmark(cfg)
