"""Traces and JSON logs: one span per request with the GenAI attributes and its
timeline, parented by an incoming W3C traceparent; OTLP/HTTP export from `serve`;
JSON log lines carrying request and trace ids."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced():
    """An in-process server whose spans land in the SDK's in-memory exporter."""
    import uvicorn
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tokenmill.cost import load_cards
    from tokenmill.engine.factory import make_engine
    from tokenmill.server.app import ServerConfig, ServicePolicy, build_app
    from tokenmill.server.options import ServeOptions

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = make_engine(ServeOptions(dtype="float32", kv_cache_gb=0.25, max_num_seqs=8, max_loras=2,
                                      max_lora_rank=16).engine_config(), "thread")
    app = build_app(engine, ServerConfig(), ServicePolicy(card=load_cards(None)["tokenmill-default"]),
                    tracer_provider=provider)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        raise RuntimeError("the in-process server did not become ready")
    yield url, exporter
    server.should_exit = True
    thread.join(60)


def spans_for(exporter, request_id: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the span ends when the exchange does, just after the body
        found = [s for s in exporter.get_finished_spans() if s.attributes.get("tokenmill.request_id") == request_id]
        if found:
            return found
        time.sleep(0.05)
    return []


def test_span_has_genai_attributes_timeline_and_parent(traced):
    url, exporter = traced
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01", "x-request-id": "client-42"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}],
                         "max_tokens": 5, "temperature": 0, "top_p": 0.9, "seed": 7, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    (span,) = spans_for(exporter, body["id"])
    from opentelemetry.trace import SpanKind, StatusCode

    assert span.kind == SpanKind.SERVER
    assert span.name == f"chat {MODEL}"
    assert format(span.context.trace_id, "032x") == TRACE_ID  # the caller's trace
    assert format(span.parent.span_id, "016x") == PARENT_SPAN
    assert r.headers["traceparent"].split("-")[1] == TRACE_ID  # and our span is handed back
    assert r.headers["traceparent"].split("-")[2] == format(span.context.span_id, "016x")
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == 0 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.request.seed"] == 7
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.response.id"] == body["id"]
    usage = body["usage"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert a["tokenmill.tenant"] == "anonymous"
    assert a["tokenmill.client_request_id"] == "client-42"
    assert a["tokenmill.cost_usd"] == pytest.approx(usage["cost"]["total_usd"])
    assert a["tokenmill.preemptions"] == 0
    assert a["http.response.status_code"] == 200
    assert 0 < a["tokenmill.ttft_s"] < 60
    assert span.status.status_code != StatusCode.ERROR
    names = [e.name for e in span.events]
    assert names == ["queued", "prefill", "first_token", "decode", "end"]
    stamps = [e.timestamp for e in span.events]
    assert stamps == sorted(stamps)  # the timeline is in order
    assert span.start_time <= stamps[0] and stamps[-1] <= span.end_time


def test_streamed_request_without_traceparent_starts_a_trace(traced):
    url, exporter = traced
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    (span,) = spans_for(exporter, lines[0]["id"])
    assert span.parent is None
    assert span.name == f"text_completion {MODEL}"
    assert span.attributes["gen_ai.usage.output_tokens"] == 4
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("length",)


def test_dialects_are_traced_and_priced_as_chat(traced):
    """/v1/messages and /v1/responses run the chat path: the same span, usage and price."""
    url, exporter = traced
    ask = [{"role": "user", "content": "Name a fruit."}]
    msg = httpx.post(url + "/v1/messages", timeout=120,
                     json={"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": ask}).json()
    with httpx.stream("POST", url + "/v1/responses", timeout=120,
                      json={"model": MODEL, "input": ask, "max_output_tokens": 4, "temperature": 0,
                            "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    resp = events[-1]["response"]
    for rid, inputs, outputs, cost in (
            (msg["id"], msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"],
             msg["usage"]["output_tokens"], msg["usage"]["cost"]["total_usd"]),
            (resp["id"], resp["usage"]["input_tokens"], resp["usage"]["output_tokens"],
             resp["usage"]["cost"]["total_usd"])):
        (span,) = spans_for(exporter, rid)
        a = span.attributes
        assert span.name == f"chat {MODEL}" and a["http.response.status_code"] == 200
        assert a["gen_ai.usage.input_tokens"] == inputs and a["gen_ai.usage.output_tokens"] == outputs > 0
        assert a["tokenmill.cost_usd"] == pytest.approx(cost) and cost > 0


def test_span_names_what_was_asked_and_the_adapter_that_answered(traced, tmp_path):
    """A request on a LoRA adapter: the span is named by the adapter the client asked for,
    and says which adapter of which base model answered; the base model's own span has
    no adapter attributes."""
    from tests.server.test_lora_server import write_adapter

    url, exporter = traced
    path = write_adapter(tmp_path / "t1", seed=5)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "t1", "lora_path": path}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        for model in ("t1", MODEL):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": "Name a colour:", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == model
            (span,) = spans_for(exporter, r.json()["id"])
            a = span.attributes
            assert span.name == f"text_completion {model}"
            assert a["gen_ai.request.model"] == model and a["gen_ai.response.model"] == model
            if model == "t1":
                assert a["tokenmill.lora_adapter"] == "t1" and a["tokenmill.base_model"] == MODEL
            else:
                assert "tokenmill.lora_adapter" not in a and "tokenmill.base_model" not in a
    finally:
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "t1"}, timeout=60)


def test_refused_request_is_an_error_span(traced):
    url, exporter = traced
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "logit_bias": {"not-a-token": 1.0}})
    assert r.status_code == 400
    deadline = time.monotonic() + 10.0
    spans = []
    while not spans and time.monotonic() < deadline:  # it ends just after the response is sent
        spans = [s for s in exporter.get_finished_spans() if s.attributes.get("http.response.status_code") == 400]
        time.sleep(0.05)
    assert spans, "a refused request still gets its span"
    from opentelemetry.trace import StatusCode

    assert spans[-1].status.status_code == StatusCode.ERROR
    assert spans[-1].attributes["error.type"] == "400"


class _Collector(BaseHTTPRequestHandler):
    received: list[bytes] = []

    def do_POST(self):  # noqa: N802 (the http.server API)
        n = int(self.headers.get("content-length", "0"))
        type(self).received.append(self.rfile.read(n))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_serve_exports_otlp_and_logs_json_lines():
    """The real CLI: spans over OTLP/HTTP to a collector, and every log line JSON."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_port}/v1/traces"
    srv = ServerProcess("--log-format", "json", "--log-level", "info", "--otlp-traces-endpoint", endpoint)
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})
        assert r.status_code == 200
    finally:
        out = srv.stop()  # SIGTERM: the server flushes its batched spans on the way out
        collector.shutdown()
    spans = []
    for payload in _Collector.received:
        req = ExportTraceServiceRequest()
        req.ParseFromString(payload)
        spans += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    mine = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    assert len(mine) == 1 and mine[0].parent_span_id.hex() == PARENT_SPAN
    attrs = {kv.key: kv.value for kv in mine[0].attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == r.json()["usage"]["completion_tokens"]

    records = [json.loads(line) for line in out.splitlines() if line.strip()]  # every line is JSON
    assert records and all({"time", "level", "logger", "message"} <= set(x) for x in records)
    done = [x for x in records if x["logger"] == "tokenmill.requests"]
    assert len(done) == 1
    assert done[0]["request_id"] == r.json()["id"] and done[0]["trace_id"] == TRACE_ID
    assert done[0]["status"] == 200 and done[0]["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert done[0]["model"] == MODEL and done[0].get("base_model") is None  # (a None field is left out)
