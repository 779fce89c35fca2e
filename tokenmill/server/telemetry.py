"""Per-request observation: a trace span, a JSON log line and the stats window.

One `RequestTrace` rides on each request's context. It is fed every engine output
(cheap: counters, and the sample's timestamps when it finishes) and closed once when
the exchange ends, however it ends. The span is built from the timestamps the engine
already records (arrival, first scheduled, first token, preemptions, finish), so
tracing adds no work to the step loop. OpenTelemetry is imported only when tracing is
on (`serve --otlp-traces-endpoint`).

Span attributes follow the OpenTelemetry GenAI semantic conventions (gen_ai.*), plus
tokenmill.* for what those do not cover (tenant, cost, request ids, preemptions).

A slow or dead collector never slows a request: a finished span only joins the batch
processor's bounded queue (dropped when full), and its thread does the exporting. On
shutdown the spans still queued get `FLUSH_S` to go out; a collector that accepts and
never answers would otherwise hold the exit for each remaining batch's export timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from tokenmill.logs import current_ids
from tokenmill.engine.api import Priority, RequestOutput, RequestTimes
from tokenmill.server.stats import StatsWindow

request_log = logging.getLogger("tokenmill.requests")
log = logging.getLogger("tokenmill.server")
FLUSH_S = 3.0  # how long the exit waits for batched spans to reach the collector


def otlp_tracer_provider(endpoint: str, service_name: str = "tokenmill"):
    """A tracer provider that batches spans to an OTLP/HTTP endpoint (e.g.
    http://collector:4318/v1/traces); spans are sent off the event loop."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class Telemetry:
    """What every request reports to: the stats window always; a tracer and the
    per-request log line when configured."""

    def __init__(self, stats: StatsWindow, model_name: str, tracer_provider: Any = None):
        self.stats = stats
        self.model_name = model_name
        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("tokenmill") if tracer_provider is not None else None
        self._propagator = None
        if self.tracer is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    def begin(self, ctx, operation: str, headers: Mapping[str, str], params: Mapping[str, Any],
              client_request_id: str | None = None) -> RequestTrace:
        trace = RequestTrace(self, ctx, operation, client_request_id)
        if self.tracer is not None:
            trace.start_span(headers, params)
        ctx.trace = trace
        current_ids.set((ctx.request_id, trace.trace_id))
        return trace

    def shutdown(self) -> None:
        if self.provider is None:
            return
        flush = threading.Thread(target=self.provider.shutdown, name="tokenmill-trace-flush", daemon=True)
        flush.start()  # (exports the spans still batched)
        flush.join(FLUSH_S)
        if flush.is_alive():
            log.warning("the trace collector did not take the last spans within %.0fs: they are dropped", FLUSH_S)


class RequestTrace:
    def __init__(self, telemetry: Telemetry, ctx, operation: str, client_request_id: str | None):
        self.t = telemetry
        self.ctx = ctx
        self.operation = operation
        self.client_request_id = client_request_id
        self.start_wall = time.time()
        self.wall_minus_mono = self.start_wall - time.monotonic()  # engine times are monotonic
        self.span = None
        self.trace_id: str | None = None
        self.traceparent: str | None = None
        self.first_seen: set[tuple[str, int]] = set()
        self.times: RequestTimes | None = None  # sample 0's, when it finished
        self.preempted: list[float] = []
        self.finish_reasons: list[str] = []
        self.num_output_tokens = 0

    # -- spans ------------------------------------------------------------------------------
    def _ns(self, mono: float) -> int:
        return int((mono + self.wall_minus_mono) * 1e9)

    def start_span(self, headers: Mapping[str, str], params: Mapping[str, Any]) -> None:
        from opentelemetry import trace as ot
        from opentelemetry.trace import SpanKind, format_trace_id

        parent = self.t._propagator.extract({k.lower(): v for k, v in headers.items()})
        # what the client named (a model, an adapter, an alias, a rollout); the span's end says what answered
        requested = params.get("model") or self.t.model_name
        attrs: dict[str, Any] = {"gen_ai.operation.name": self.operation, "gen_ai.request.model": requested,
                                 "gen_ai.provider.name": "tokenmill"}
        for key in ("max_tokens", "temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty"):
            v = params.get(key)
            if v is not None:
                attrs[f"gen_ai.request.{key}"] = v
        if params.get("n", 1) != 1:
            attrs["gen_ai.request.choice.count"] = params["n"]
        self.span = self.t.tracer.start_span(f"{self.operation} {requested}", context=parent,
                                             kind=SpanKind.SERVER, start_time=int(self.start_wall * 1e9),
                                             attributes=attrs)
        sc = self.span.get_span_context()
        self.trace_id = format_trace_id(sc.trace_id)
        carrier: dict[str, str] = {}
        self.t._propagator.inject(carrier, context=ot.set_span_in_context(self.span))
        self.traceparent = carrier.get("traceparent")
        self.span.add_event("queued", timestamp=int(self.start_wall * 1e9))

    # -- feeding ----------------------------------------------------------------------------
    def observe(self, out: RequestOutput, prompt: int = 0) -> None:
        key = (out.request_id, out.index)
        first = key not in self.first_seen
        if first:
            self.first_seen.add(key)
        self.t.stats.observe(self.ctx.tenant or "anonymous", out, first)
        self.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            self.finish_reasons.append(out.finish_reason or "unknown")
            if out.times is not None:
                self.preempted.extend(out.times.preempted)
                if out.index == 0 and self.times is None:
                    self.times = out.times

    # -- the end ----------------------------------------------------------------------------
    def end(self, status: int, usage: dict[str, Any] | None) -> None:
        ctx = self.ctx
        tenant = ctx.tenant or "anonymous"
        cost = ctx.cost_usd
        self.t.stats.settle(tenant, status, usage, cost)
        end_wall = time.time()
        usage = usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        t = self.times
        ttft = (t.first_token - t.arrival) if t is not None and t.first_token is not None else None
        if self.span is not None:
            self._close_span(status, usage, cached, cost, end_wall)
        if request_log.isEnabledFor(logging.INFO):
            request_log.info("%s finished: %d", ctx.request_id, status, extra={"fields": {
                "request_id": ctx.request_id, "client_request_id": self.client_request_id,
                "trace_id": self.trace_id, "tenant": tenant, "operation": self.operation, "status": status,
                "model": ctx.model or self.t.model_name, "base_model": ctx.base_model,
                "finish_reasons": self.finish_reasons, "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": cached, "completion_tokens": usage.get("completion_tokens"),
                "ttft_s": None if ttft is None else round(ttft, 6),
                "duration_s": round(end_wall - self.start_wall, 6), "preemptions": len(self.preempted),
                "cost_usd": cost}})

    def _close_span(self, status: int, usage: dict[str, Any], cached: int, cost: float | None,
                    end_wall: float) -> None:
        from opentelemetry.trace import Status, StatusCode

        span, t = self.span, self.times
        span.set_attribute("gen_ai.response.model", self.ctx.model or self.t.model_name)
        if self.ctx.base_model is not None:  # answered by a LoRA adapter of that model
            span.set_attribute("tokenmill.lora_adapter", self.ctx.model)
            span.set_attribute("tokenmill.base_model", self.ctx.base_model)
        span.set_attribute("gen_ai.response.id", self.ctx.request_id)
        if self.finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", self.finish_reasons)
        if usage:
            span.set_attribute("gen_ai.usage.input_tokens", usage.get("prompt_tokens", 0))
            span.set_attribute("gen_ai.usage.output_tokens", usage.get("completion_tokens", 0))
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("tokenmill.tenant", self.ctx.tenant or "anonymous")
        span.set_attribute("tokenmill.request_id", self.ctx.request_id)
        if self.client_request_id:
            span.set_attribute("tokenmill.client_request_id", self.client_request_id)
        span.set_attribute("tokenmill.request_class",
                           "batch" if self.ctx.priority == Priority.BATCH else "interactive")
        span.set_attribute("tokenmill.preemptions", len(self.preempted))
        if cost is not None:
            span.set_attribute("tokenmill.cost_usd", cost)
        if t is not None:
            if t.first_scheduled is not None:
                span.add_event("prefill", timestamp=self._ns(t.first_scheduled))
            if t.first_token is not None:
                span.add_event("first_token", timestamp=self._ns(t.first_token))
                span.set_attribute("tokenmill.ttft_s", t.first_token - t.arrival)
                span.add_event("decode", timestamp=self._ns(t.first_token))
        for p in self.preempted:
            span.add_event("preempted", timestamp=self._ns(p))
        span.add_event("end", timestamp=int(end_wall * 1e9))
        if status >= 400:
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end(end_time=int(end_wall * 1e9))
