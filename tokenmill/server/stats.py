"""What the console's dashboard reads: GET /v1/stats.

A rolling window of fixed buckets (5 s, the last 10 minutes) fed as outputs stream:
tokens per second, TTFT and ITL percentiles, finished requests by status, per tenant
so that a tenant's view holds only its own traffic. Server-wide totals are read from
the Prometheus registry itself, so the dashboard and /metrics cannot disagree.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.engine.api import EngineStats, RequestOutput
from tokenmill.server.metrics import Metrics

BUCKET_S = 5.0
HORIZON_S = 600.0
MAX_GAPS_PER_PART = 20_000  # inter-token gaps kept per bucket and tenant (a sample beyond it is dropped)


@dataclass
class _Part:
    """One tenant's traffic in one bucket."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # HTTP status -> requests
    ttft: list[float] = field(default_factory=list)
    gaps: list[np.ndarray] = field(default_factory=list)
    num_gaps: int = 0


@dataclass
class _Bucket:
    start: float  # wall-clock seconds
    parts: dict[str, _Part] = field(default_factory=dict)


@dataclass(frozen=True)
class Served:
    """One finished request's latency, for objectives: time to first token and mean
    time per output token after it (TPOT; None with one token)."""
    at: float  # wall-clock seconds, when it finished
    tenant: str
    ttft: float
    tpot: float | None
    arrived: float = -math.inf  # wall-clock seconds

    def meets(self, ttft_s: float, itl_s: float) -> bool:
        return self.ttft <= ttft_s and (self.tpot is None or self.tpot <= itl_s)


@dataclass
class TenantTotals:
    requests: int = 0
    errors: int = 0  # finished with a status >= 400
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


class StatsWindow:
    def __init__(self, clock: Callable[[], float] = time.time, bucket_s: float = BUCKET_S,
                 horizon_s: float = HORIZON_S):
        self.clock = clock
        self.bucket_s = bucket_s
        self.horizon_s = horizon_s
        self.buckets: deque[_Bucket] = deque(maxlen=int(horizon_s // bucket_s))
        self.totals: dict[str, TenantTotals] = {}
        self.served: deque[Served] = deque(maxlen=100_000)  # the horizon's finished requests
        self._lock = threading.Lock()

    def _part(self, tenant: str) -> _Part:
        now = self.clock()
        start = math.floor(now / self.bucket_s) * self.bucket_s
        if not self.buckets or self.buckets[-1].start < start:
            self.buckets.append(_Bucket(start))
        return self.buckets[-1].parts.setdefault(tenant, _Part())

    # -- feeding (event loop) ---------------------------------------------------------------
    def observe(self, tenant: str, out: RequestOutput, first: bool) -> None:
        """One output of a request; `first`: the request's first output (its prompt is done)."""
        with self._lock:
            p = self._part(tenant)
            p.output_tokens += len(out.new_token_ids)
            if first and out.index == 0:
                p.prompt_tokens += out.num_prompt_tokens
                p.cached_tokens += out.num_cached_tokens
            t = out.times
            if out.finished and t is not None:
                if out.index == 0 and t.first_token is not None:
                    p.ttft.append(t.first_token - t.arrival)
                    n = len(t.tokens)
                    tpot = (t.tokens[-1] - t.first_token) / (n - 1) if n > 1 else None
                    now = self.clock()
                    arrived = now - (t.finished - t.arrival) if t.finished is not None else -math.inf
                    self.served.append(Served(now, tenant, t.first_token - t.arrival, tpot, arrived))
                if len(t.tokens) > 1 and p.num_gaps < MAX_GAPS_PER_PART:
                    gaps = np.diff(np.asarray(t.tokens, dtype=np.float64))
                    p.gaps.append(gaps)
                    p.num_gaps += gaps.size

    def settle(self, tenant: str, status: int, usage: dict[str, Any] | None, cost_usd: float | None) -> None:
        """A request ended (however it ended)."""
        with self._lock:
            p = self._part(tenant)
            key = str(status)
            p.finished[key] = p.finished.get(key, 0) + 1
            tot = self.totals.setdefault(tenant, TenantTotals())
            tot.requests += 1
            tot.errors += status >= 400
            if usage:
                tot.prompt_tokens += usage.get("prompt_tokens", 0)
                tot.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                tot.completion_tokens += usage.get("completion_tokens", 0)
            if cost_usd:
                tot.cost_usd += cost_usd

    # -- reading ----------------------------------------------------------------------------
    def served_since(self, since: float, tenant: str | None = None, arrived_since: float = -math.inf) -> list[Served]:
        """Requests finished since `since` (and, with `arrived_since`, that arrived after it)."""
        with self._lock:
            out = []
            for r in reversed(self.served):
                if r.at < since:
                    break
                if (tenant is None or r.tenant == tenant) and r.arrived >= arrived_since:
                    out.append(r)
        return out[::-1]

    def series(self, tenant: str | None, window_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """(per-bucket series over the horizon, summary over the last `window_s`) for one
        tenant, or for all when `tenant` is None."""
        now = self.clock()
        with self._lock:
            buckets = list(self.buckets)
        start = math.floor(now / self.bucket_s) * self.bucket_s
        n = self.buckets.maxlen or 1
        slots = [start - (n - 1 - i) * self.bucket_s for i in range(n)]
        by_start = {b.start: b for b in buckets}
        cols: dict[str, list[Any]] = {k: [] for k in ("t", "prompt_tps", "output_tps", "ttft_p50", "ttft_p99",
                                                      "itl_p50", "itl_p99", "requests", "errors")}
        recent_ttft: list[float] = []
        recent_gaps: list[np.ndarray] = []
        recent = {"prompt_tokens": 0, "output_tokens": 0, "requests": 0, "errors": 0}
        status: dict[str, int] = {}
        for s in slots:
            parts = [] if s not in by_start else [
                p for name, p in by_start[s].parts.items() if tenant is None or name == tenant]
            span = min(self.bucket_s, max(now - s, 1e-3))  # the current bucket is partly elapsed
            prompt = sum(p.prompt_tokens for p in parts)
            output = sum(p.output_tokens for p in parts)
            ttft = np.asarray([v for p in parts for v in p.ttft], dtype=np.float64)
            gaps = np.concatenate([g for p in parts for g in p.gaps]) if any(p.gaps for p in parts) \
                else np.zeros(0)
            finished = {}
            for p in parts:
                for k, v in p.finished.items():
                    finished[k] = finished.get(k, 0) + v
            errors = sum(v for k, v in finished.items() if int(k) >= 400)
            cols["t"].append(s)
            cols["prompt_tps"].append(prompt / span)
            cols["output_tps"].append(output / span)
            cols["ttft_p50"].append(_pct(ttft, 50))
            cols["ttft_p99"].append(_pct(ttft, 99))
            cols["itl_p50"].append(_pct(gaps, 50))
            cols["itl_p99"].append(_pct(gaps, 99))
            cols["requests"].append(sum(finished.values()))
            cols["errors"].append(errors)
            if s + self.bucket_s > now - window_s:
                recent_ttft.extend(ttft.tolist())
                if gaps.size:
                    recent_gaps.append(gaps)
                recent["prompt_tokens"] += prompt
                recent["output_tokens"] += output
                recent["requests"] += sum(finished.values())
                recent["errors"] += errors
                for k, v in finished.items():
                    status[k] = status.get(k, 0) + v
        ttft_all = np.asarray(recent_ttft, dtype=np.float64)
        gaps_all = np.concatenate(recent_gaps) if recent_gaps else np.zeros(0)
        summary = {
            "seconds": window_s, **recent,
            "prompt_tps": recent["prompt_tokens"] / window_s, "output_tps": recent["output_tokens"] / window_s,
            "ttft_p50": _pct(ttft_all, 50), "ttft_p99": _pct(ttft_all, 99),
            "itl_p50": _pct(gaps_all, 50), "itl_p99": _pct(gaps_all, 99),
            "requests_by_status": status,
        }
        return {"bucket_s": self.bucket_s, **cols}, summary


def engine_block(s: EngineStats) -> dict[str, Any]:
    return {
        "running": s.num_running, "waiting": s.num_waiting, "waiting_interactive": s.num_waiting_interactive,
        "waiting_batch": s.num_waiting_batch, "kv_blocks_used": s.kv_blocks_used,
        "kv_blocks_total": s.kv_blocks_total, "prefix_cache_queries_tokens": s.prefix_queries,
        "prefix_cache_hits_tokens": s.prefix_hits,
        "prefix_cache_hit_rate": s.prefix_hits / s.prefix_queries if s.prefix_queries else None,
        "preemptions": s.num_preemptions, "engine_restarts": s.engine_restarts,
        "kv_disk": None if not s.kv_disk_capacity_bytes else {
            "hit_rate": s.kv_disk_hit_tokens / s.kv_disk_lookup_tokens if s.kv_disk_lookup_tokens else None,
            "hit_tokens": s.kv_disk_hit_tokens, "used_bytes": s.kv_disk_used_bytes,
            "capacity_bytes": s.kv_disk_capacity_bytes, "files": s.kv_disk_files,
            "read_bytes": s.kv_disk_read_bytes, "written_bytes": s.kv_disk_written_bytes,
            "restore_mean_s": s.kv_disk_restore_seconds / s.kv_disk_restores if s.kv_disk_restores else None,
            "faults": s.kv_disk_faults,
        },
    }


def registry_totals(metrics: Metrics, parent_of: Callable[[str], str | None] = lambda name: None) -> dict[str, Any]:
    """Server-wide totals, read from the same registry /metrics renders; `parent_of` names a
    LoRA adapter's base model (None for a model, or an adapter no longer loaded)."""
    reg = metrics.registry

    def value(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, labels or None) or 0.0

    by_reason: dict[str, int] = {}
    by_status: dict[str, int] = {}
    cost = 0.0
    models: dict[str, dict[str, Any]] = {}
    model_fields = {"tokenmill_model_requests_total": "samples", "tokenmill_model_prompt_tokens_total": "prompt_tokens",
                    "tokenmill_model_generation_tokens_total": "generation_tokens"}

    def model_row(name: str) -> dict[str, Any]:
        return models.setdefault(name, {"samples": 0, "prompt_tokens": 0, "generation_tokens": 0, "cost_usd": 0.0})

    for family in reg.collect():
        for sample in family.samples:
            if sample.name == "tokenmill_requests_total":
                by_reason[sample.labels["finish_reason"]] = int(sample.value)
            elif sample.name == "tokenmill_http_responses_total":
                by_status[sample.labels["status_code"]] = int(sample.value)
            elif sample.name == "tokenmill_cost_usd_total":
                cost += sample.value
                model_row(sample.labels["model"])["cost_usd"] += sample.value
            elif sample.name in model_fields:
                model_row(sample.labels["model"])[model_fields[sample.name]] = int(sample.value)
    return {
        "prompt_tokens": int(value("tokenmill_prompt_tokens_total")),
        "cached_prompt_tokens": int(value("tokenmill_cached_prompt_tokens_total")),
        "generation_tokens": int(value("tokenmill_generation_tokens_total")),
        "samples_by_finish_reason": by_reason,
        "responses_by_status": by_status,
        "cost_usd": cost,
        # by the model or LoRA adapter requests named (its spend priced at its own card)
        "models": [{"model": name, "parent": parent_of(name), **row} for name, row in sorted(models.items())],
    }
