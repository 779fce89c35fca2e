"""Prometheus metrics, in a registry owned by one app (two servers in one process
don't share counters). Gauges are read from the engine at scrape time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                   SummaryMetricFamily)

from tokenmill.engine.api import EngineStats, RequestOutput

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
            20.0, 40.0, 80.0)
_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


# per-replica gauges behind `tokenmill cluster serve`: (metric name, EngineStats field, help)
_REPLICA_GAUGES = (
    ("num_requests_running", "num_running", "Requests running on the replica."),
    ("num_requests_waiting", "num_waiting", "Requests waiting on the replica."),
    ("kv_blocks_used", "kv_blocks_used", "KV cache blocks held on the replica."),
    ("prefix_cache_queries_tokens", "prefix_queries", "Prompt tokens looked up in its cache."),
    ("prefix_cache_hits_tokens", "prefix_hits", "Prompt tokens found in its cache."),
    ("generation_tokens", "generation_tokens", "Output tokens it generated."),
)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats], replicas: Callable[[], dict] | None = None,
                 decisions: Callable[[], dict[str, int]] | None = None):
        self._stats = stats
        self._replicas = replicas
        self._decisions = decisions

    def _cluster(self) -> Iterable[GaugeMetricFamily]:
        """Behind `tokenmill cluster serve`: each replica's own engine figures, labelled."""
        reports = self._replicas()
        yield GaugeMetricFamily("tokenmill_replicas", "Engine replicas reporting.", value=len(reports))
        families = {key: GaugeMetricFamily(f"tokenmill_replica_{name}", doc, labels=["replica"])
                    for name, key, doc in _REPLICA_GAUGES}
        routed = CounterMetricFamily("tokenmill_replica_requests", "Requests routed to the replica.",
                                     labels=["replica"])
        for rid, r in reports.items():
            for key, family in families.items():
                family.add_metric([rid], r["stats"][key])
            routed.add_metric([rid], r["requests"])
        yield from families.values()
        yield routed
        if self._decisions is not None:
            d = CounterMetricFamily("tokenmill_router_decisions", "Prefix-affinity routing decisions: hit (to the "
                                    "replica holding the prefix), miss (no replica known), load_guard (the "
                                    "holder was too busy).", labels=["decision"])
            for name, value in self._decisions().items():
                d.add_metric([name], value)
            yield d

    @staticmethod
    def _disk(s: EngineStats) -> Iterable[GaugeMetricFamily]:
        """The prefix cache's disk tier (served with --kv-disk-dir). prefix_cache_hits counts
        the tokens read back from disk too: memory's share is the difference."""
        for name, doc, value in (
            ("tokenmill_kv_disk_lookup_tokens", "Prompt tokens in full blocks memory lacked, looked up on disk.",
             s.kv_disk_lookup_tokens),
            ("tokenmill_kv_disk_hit_tokens", "Prompt tokens read back from disk instead of recomputed.",
             s.kv_disk_hit_tokens),
            ("tokenmill_kv_disk_read_bytes", "Bytes read from KV block files.", s.kv_disk_read_bytes),
            ("tokenmill_kv_disk_written_bytes", "Bytes written to KV block files.", s.kv_disk_written_bytes),
            ("tokenmill_kv_disk_faults", "Bad block files (truncated, corrupt, foreign) and failed writes "
                                         "(no space, I/O); each cost a recompute or a block kept in memory only.",
             s.kv_disk_faults),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield SummaryMetricFamily("tokenmill_kv_disk_restore_seconds", "Time from a prompt's lookup to its "
                                  "prefix being read back from disk.", count_value=s.kv_disk_restores,
                                  sum_value=s.kv_disk_restore_seconds)
        for name, doc, value in (
            ("tokenmill_kv_disk_used_bytes", "Bytes of KV block files on disk.", s.kv_disk_used_bytes),
            ("tokenmill_kv_disk_capacity_bytes", "The disk tier's size cap (--kv-disk-gb).", s.kv_disk_capacity_bytes),
            ("tokenmill_kv_disk_files", "KV block files on disk.", s.kv_disk_files),
        ):
            yield GaugeMetricFamily(name, doc, value=value)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self._stats()
        for name, doc, value in (
            ("tokenmill_num_requests_running", "Requests in the running queue.", s.num_running),
            ("tokenmill_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("tokenmill_kv_blocks_used", "KV cache blocks held by requests.", s.kv_blocks_used),
            ("tokenmill_kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total),
            ("tokenmill_kv_pinned_blocks", "KV cache blocks cache_control breakpoints keep until their TTL.",
             s.kv_pinned_blocks),
            ("tokenmill_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
             s.prefix_queries),
            ("tokenmill_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.", s.prefix_hits),
            ("tokenmill_preemptions", "Requests preempted for lack of KV blocks (cumulative).",
             s.num_preemptions),
            ("tokenmill_engine_restarts", "Times the engine was restarted after it died (cumulative).",
             s.engine_restarts),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("tokenmill_spec_draft_tokens", "Speculative draft tokens checked by the model.", s.spec_draft_tokens),
            ("tokenmill_spec_accepted_tokens", "Speculative draft tokens accepted.", s.spec_accepted_tokens),
            ("tokenmill_spec_verifications", "Request-steps that checked speculative drafts.",
             s.spec_verifications),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if s.kv_disk_capacity_bytes:
            yield from self._disk(s)
        mean = 1.0 + s.spec_accepted_tokens / s.spec_verifications if s.spec_verifications else 0.0
        yield GaugeMetricFamily("tokenmill_spec_mean_accepted_length",
                                "Tokens a request got per step that checked its drafts (1 + accepted; "
                                "0 before any).", value=mean)
        if self._replicas is not None and self._replicas() is not None:  # None: a single engine
            yield from self._cluster()


class BulkHistogram:
    """A histogram that takes many observations in one vectorized call: a request's
    inter-token gaps are as many as the tokens the client asked for, and observing them
    one by one on the event loop would be a loop whose length the client chooses."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.doc = name, doc
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # the last: above every bound
        self.sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: np.ndarray) -> None:
        if values.size == 0:
            return
        idx = np.searchsorted(self.bounds, values, side="left")  # bucket i holds values <= bounds[i]
        binned = np.bincount(idx, minlength=len(self.counts))
        with self._lock:
            self.counts += binned
            self.sum += float(values.sum())

    def collect(self) -> Iterable[HistogramMetricFamily]:
        with self._lock:
            cum = np.cumsum(self.counts)
            total = self.sum
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cum)] + [("+Inf", int(cum[-1]))]
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class _ModelsCollector:
    """With several models (engine/models.py): each model's state and memory, labelled."""

    def __init__(self, states: Callable[[], list[dict]]):
        self._states = states

    def collect(self) -> Iterable[GaugeMetricFamily]:
        loaded = GaugeMetricFamily("tokenmill_model_loaded", "1 while the model is loaded (0.5 loading or "
                                   "unloading, 0 not in memory).", labels=["model"])
        memory = GaugeMetricFamily("tokenmill_model_memory_bytes", "The model's estimated weights and KV cache "
                                   "while it is in memory (0 otherwise).", labels=["model"])
        rss = GaugeMetricFamily("tokenmill_model_rss_bytes", "Resident memory of the model's engine process.",
                                labels=["model"])
        loads = CounterMetricFamily("tokenmill_model_loads", "Times the model was loaded.", labels=["model"])
        for m in self._states():
            state = m["state"]
            loaded.add_metric([m["id"]], 1.0 if state == "loaded" else 0.0 if state == "available" else 0.5)
            memory.add_metric([m["id"]], 0 if state == "available" else m["memory"]["estimate_bytes"])
            rss.add_metric([m["id"]], m["memory"]["rss_bytes"] or 0)
            loads.add_metric([m["id"]], m["loads"])
        yield from (loaded, memory, rss, loads)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], replicas: Callable[[], dict] | None = None,
                 decisions: Callable[[], dict[str, int]] | None = None,
                 models: Callable[[], list[dict]] | None = None):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("tokenmill_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY, registry=r)
        self.itl = BulkHistogram("tokenmill_inter_token_latency_seconds", "Time between output tokens.",
                                 _LATENCY, r)
        self.loop_lag = Gauge("tokenmill_event_loop_lag_seconds",
                              "How late the server's event loop ran a timer, at the last sample.", registry=r)
        self.loop_lag_max = Gauge("tokenmill_event_loop_lag_max_seconds",
                                  "The largest event loop lag sampled since the last scrape.", registry=r)
        self._lag_max = 0.0
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
        self.reasoning_tokens = Counter("tokenmill_reasoning_tokens",
                                        "Output tokens inside thinking blocks (tags included).", registry=r)
        self.requests = Counter("tokenmill_requests", "Finished samples by finish reason.",
                                ["finish_reason"], registry=r)
        self.responses = Counter("tokenmill_http_responses", "HTTP responses by status code.",
                                 ["status_code"], registry=r)
        self.aborted = Counter("tokenmill_aborted_requests", "Requests the server cut off, by reason (slow_client: "
                               "its client read nothing for --write-timeout).", ["reason"], registry=r)
        self.connections = Gauge("tokenmill_http_connections", "Open HTTP connections (idle ones included).",
                                 registry=r)
        self.connections_closed = Counter("tokenmill_connections_closed", "Connections the server closed to "
                                          "protect itself, by reason: header_timeout, body_timeout, write_stall, "
                                          "connection_cap (refused), evicted_idle (closed to make room).", ["reason"], registry=r)
        self.cost = Counter("tokenmill_cost_usd", "Priced cost of requests in USD.", ["tenant", "model"],
                            registry=r)
        self.alarm_raised = Counter("tokenmill_spend_alarms", "Times a spend alarm was raised, by scope "
                                    "(server, or tenant:NAME).", ["scope"], registry=r)
        self.alarm_active = Gauge("tokenmill_spend_alarm_active", "1 while the scope's spend alarm is raised.",
                                  ["scope"], registry=r)
        self.alarm_window_usd = Gauge("tokenmill_spend_alarm_window_usd",
                                      "Spend in the alarm's trailing window, at the last request of the scope.",
                                      ["scope"], registry=r)
        self.alarm_refusals = Counter("tokenmill_spend_alarm_refusals", "Requests refused by a blocking spend "
                                      "alarm.", ["scope"], registry=r)
        self.cap_hits = Counter("tokenmill_work_cap_hits", "Requests cut or refused by a work cap.",
                                ["cap"], registry=r)
        self.autotune_knob = Gauge("tokenmill_autotune_knob", "A knob's value as the SLO autotuner set it.",
                                   ["knob"], registry=r)
        self.autotune_changes = Counter("tokenmill_autotune_changes", "Knob changes the SLO autotuner made.",
                                        ["knob", "direction"], registry=r)
        # per model (one series per served model; the totals above stay unlabelled)
        self.model_requests = Counter("tokenmill_model_requests", "Finished samples by the model or LoRA adapter they named.", ["model"],
                                      registry=r)
        self.model_prompt_tokens = Counter("tokenmill_model_prompt_tokens", "Prompt tokens of finished requests "
                                           "by model.", ["model"], registry=r)
        self.model_generation_tokens = Counter("tokenmill_model_generation_tokens", "Output tokens by model.",
                                               ["model"], registry=r)
        r.register(_EngineCollector(stats, replicas, decisions))
        if models is not None:
            r.register(_ModelsCollector(models))

    def observe_finished(self, out: RequestOutput, model: str | None = None) -> None:
        """Record one finished sample (the first sample also records its prompt), under
        `model` too when given."""
        if model is not None:
            self.model_requests.labels(model=model).inc()
            self.model_generation_tokens.labels(model=model).inc(out.num_output_tokens)
            if out.index == 0:
                self.model_prompt_tokens.labels(model=model).inc(out.num_prompt_tokens)
        t = out.times
        if t is not None:
            if out.index == 0:
                if t.first_token is not None:
                    self.ttft.observe(t.first_token - t.arrival)
                if t.first_scheduled is not None:
                    self.queue.observe(t.first_scheduled - t.arrival)
            if t.finished is not None:
                self.e2e.observe(t.finished - t.arrival)
            if len(t.tokens) > 1:
                self.itl.observe_many(np.diff(np.asarray(t.tokens, dtype=np.float64)))
        if out.index == 0:
            self.prompt_len.observe(out.num_prompt_tokens)
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.cached_tokens.inc(out.num_cached_tokens)
        self.output_len.observe(out.num_output_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        self.reasoning_tokens.inc(out.num_reasoning_tokens)
        self.requests.labels(finish_reason=out.finish_reason or "unknown").inc()

    def observe_cut(self, reason: str, in_flight: bool) -> None:
        """A connection closed by its guards (server/connections.py)."""
        self.connections_closed.labels(reason=reason).inc()
        if in_flight and reason == "write_stall":
            self.aborted.labels(reason="slow_client").inc()

    def observe_loop_lag(self, lag_s: float) -> None:
        self.loop_lag.set(lag_s)
        self._lag_max = max(self._lag_max, lag_s)
        self.loop_lag_max.set(self._lag_max)

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        self._lag_max = 0.0
        return text
