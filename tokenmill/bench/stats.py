"""Summaries of a run: percentiles, throughput and goodput, in the results-JSON shape.

Goodput: requests per second that succeeded AND had TTFT <= the TTFT objective AND a
mean ITL (mean of that request's inter-token gaps) <= the ITL objective. The mean,
not the max, is used: it is what a reader perceives as streaming speed and what
vLLM and DistServe call TPOT-based goodput; one scheduler hiccup should not fail a
request. A request with a single chunk has no gaps and passes the ITL test. An
objective that is not given is not checked (with neither, goodput = requests/s).

Throughputs divide by the run's wall time (first send to last completion), so they
include ramp-up and tail; output tokens come from server usage where it was sent.

Cached-token share: prompt tokens the server said its prefix cache served
(`usage.prompt_tokens_details.cached_tokens`) over all prompt tokens, counting only
successful requests whose usage said both; None when the server said neither.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from tokenmill.bench.client import RequestRecord
from tokenmill.bench.runner import RunOutcome

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput; None means not checked."""

    ttft_ms: Optional[float] = None
    itl_ms: Optional[float] = None

    def met_by(self, rec: RequestRecord) -> bool:
        if not rec.ok:
            return False
        if self.ttft_ms is not None and (rec.ttft_ms is None or rec.ttft_ms > self.ttft_ms):
            return False
        itl = rec.mean_itl_ms
        if self.itl_ms is not None and itl is not None and itl > self.itl_ms:
            return False
        return True


def summarize(values: Sequence[float]) -> dict[str, Optional[float]]:
    """p50/p90/p95/p99/mean (linear interpolation); all None for no values."""
    if len(values) == 0:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, Optional[float]] = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["mean"] = float(arr.mean())
    return out


def cache_summary(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    told = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached, prompt = sum(r.cached_tokens or 0 for r in told), sum(r.prompt_tokens or 0 for r in told)
    return {"cached_tokens_total": cached if told else None,
            "cached_token_share": cached / prompt if told else None}


def by_turn(ok: Sequence[RequestRecord]) -> Optional[dict[str, Any]]:
    """Agent runs: TTFT and cached-token share of each turn (from 1) across conversations."""
    turns = sorted({r.turn for r in ok if r.turn is not None})
    if not turns:
        return None
    out = {}
    for t in turns:
        mine = [r for r in ok if r.turn == t]
        ttft = summarize([r.ttft_ms for r in mine if r.ttft_ms is not None])
        out[str(t + 1)] = {"requests": len(mine), "ttft_ms": ttft, **cache_summary(mine)}
    return out


def run_summary(outcome: RunOutcome, slo: Slo) -> dict[str, Any]:
    """One entry of `runs` in results.json (the schema other tools consume)."""
    spec, recs, dur = outcome.spec, outcome.records, outcome.duration_s
    ok = [r for r in recs if r.ok]
    errors = Counter(r.error_kind or "unknown" for r in recs if not r.ok)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    good = sum(1 for r in recs if slo.met_by(r))
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    decode = [d for d in (r.decode_tokens_per_s for r in ok) if d is not None]
    return {
        "label": spec.label,
        "mode": spec.mode,
        "concurrency": spec.concurrency,
        "request_rate": spec.request_rate,
        "duration_s": dur,
        "num_requests": len(recs),
        "num_ok": len(ok),
        "num_errors": len(recs) - len(ok),
        "errors_by_kind": dict(sorted(errors.items())),
        "input_tokens_total": in_tok,
        "output_tokens_total": out_tok,
        "output_tokens_per_s": per_s(out_tok),
        "total_tokens_per_s": per_s(in_tok + out_tok),
        "requests_per_s": per_s(len(ok)),
        "goodput_rps": per_s(good),
        "num_good": good,
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms, "itl_statistic": "mean"},
        "usage_source": dict(Counter(r.usage_source for r in ok if r.usage_source)),
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in ok)),
        # Successful answers shorter than max_tokens: the server stopped at EOS (ignore_eos
        # unsupported or off), so token counts differ from what was asked.
        "num_short_outputs": sum(1 for r in ok if r.output_tokens < r.requested_output_tokens),
        "ttft_ms": summarize([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        # ITL pools every gap of every successful request: a long answer weighs more.
        "itl_ms": summarize([g for r in ok for g in r.itl_ms]),
        "e2e_ms": summarize([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "decode_tokens_per_s_per_stream": summarize(decode),
        **cache_summary(ok),
        "by_turn": by_turn(ok),
        "requests": [r.to_json() for r in recs],
    }
