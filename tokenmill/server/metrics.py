"""Prometheus metrics, in a registry owned by one app (two servers in one process
don't share counters). Gauges are read from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tokenmill.engine.llm_engine import EngineStats
from tokenmill.engine.output import RequestOutput

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
            20.0, 40.0, 80.0)
_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self._stats()
        for name, doc, value in (
            ("tokenmill_num_requests_running", "Requests in the running queue.", s.num_running),
            ("tokenmill_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("tokenmill_kv_blocks_used", "KV cache blocks held by requests.", s.kv_blocks_used),
            ("tokenmill_kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total),
            ("tokenmill_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
             s.prefix_queries),
            ("tokenmill_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.", s.prefix_hits),
            ("tokenmill_preemptions", "Requests preempted for lack of KV blocks (cumulative).",
             s.num_preemptions),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("tokenmill_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("tokenmill_inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("tokenmill_e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("tokenmill_request_queue_time_seconds", "Arrival to first scheduled.",
                               buckets=_LATENCY, registry=r)
        self.prompt_len = Histogram("tokenmill_request_prompt_tokens", "Prompt length.", buckets=_TOKENS,
                                    registry=r)
        self.output_len = Histogram("tokenmill_request_generation_tokens", "Output length per sample.",
                                    buckets=_TOKENS, registry=r)
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.cached_tokens = Counter("tokenmill_cached_prompt_tokens", "Prompt tokens served from cache.",
                                     registry=r)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "Output tokens.", registry=r)
        self.requests = Counter("tokenmill_requests", "Finished samples by finish reason.",
                                ["finish_reason"], registry=r)
        self.responses = Counter("tokenmill_http_responses", "HTTP responses by status code.",
                                 ["status_code"], registry=r)
        self.cost = Counter("tokenmill_cost_usd", "Priced cost of requests in USD.", ["tenant", "model"],
                            registry=r)
        self.cap_hits = Counter("tokenmill_work_cap_hits", "Requests cut or refused by a work cap.",
                                ["cap"], registry=r)
        r.register(_EngineCollector(stats))

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished sample (the first sample also records its prompt)."""
        t = out.times
        if t is not None:
            if out.index == 0:
                if t.first_token is not None:
                    self.ttft.observe(t.first_token - t.arrival)
                if t.first_scheduled is not None:
                    self.queue.observe(t.first_scheduled - t.arrival)
            if t.finished is not None:
                self.e2e.observe(t.finished - t.arrival)
            for a, b in zip(t.tokens, t.tokens[1:]):
                self.itl.observe(b - a)
        if out.index == 0:
            self.prompt_len.observe(out.num_prompt_tokens)
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.cached_tokens.inc(out.num_cached_tokens)
        self.output_len.observe(out.num_output_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        self.requests.labels(finish_reason=out.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
