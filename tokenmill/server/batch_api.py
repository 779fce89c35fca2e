"""OpenAI's Files and Batches API over tokenmill/batch: /v1/files and /v1/batches.

Each batch line runs through the same serving code as a live request (so its answer
is the live answer), in the batch class: scheduled after interactive work, preempted
by it, priced at the rate card's batch rates. A tenant sees only its own files and
batches; another tenant's id gets the same 404 as an id that never existed.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from decimal import Decimal
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from starlette.responses import FileResponse, JSONResponse

from tokenmill.batch.runner import (ENDPOINTS, BatchLimits, BatchRunner, LineError, LineOutcome,
                                    parse_window)
from tokenmill.batch.storage import StoreBusy, storage_error
from tokenmill.batch.store import BatchStore
from tokenmill.engine.api import EngineDeadError
from tokenmill.server.errors import APIError, as_api_error
from tokenmill.server.key_cache import KeyCache
from tokenmill.server.keys import Tenant
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.serving import RequestContext, new_id

MAX_METADATA = 16


class ServerLineExecutor:
    """Runs and validates batch lines the way the live routes run requests."""

    def __init__(self, chat, completion, gate, pricer, keys: KeyCache | None, open_tenant: Tenant, telemetry=None):
        self.routes = {"/v1/chat/completions": (chat, ChatCompletionRequest, "chatcmpl"),
                       "/v1/completions": (completion, CompletionRequest, "cmpl")}
        self.gate = gate
        self.pricer = pricer
        self.keys = keys
        self.open_tenant = open_tenant
        self.telemetry = telemetry  # tokenmill.server.telemetry.Telemetry: lines are traced and counted too

    async def tenant(self, name: str) -> Tenant | None:
        if self.keys is None:
            return self.open_tenant if name == self.open_tenant.name else None
        return await self.keys.tenant(name)

    def _parse(self, url: str, body: dict[str, Any]):
        serving, model, prefix = self.routes[url]
        parsed = model.model_validate(body)
        if parsed.stream:
            raise APIError(400, "a batch request cannot stream", param="stream")
        return serving, parsed, prefix

    async def validate(self, tenant: str, url: str, body: dict[str, Any]) -> None:
        try:
            serving, parsed, _ = self._parse(url, body)
            await serving.prepare_body(parsed, RequestContext(request_id="validate"))
        except Exception as exc:
            err = as_api_error(exc)
            if err is None:
                raise
            raise LineError(err.code or "invalid_request", err.message, err.param) from None

    async def execute(self, tenant: str, url: str, body: dict[str, Any]) -> LineOutcome:
        request_id = f"req_{uuid.uuid4().hex}"
        try:
            who = await self.tenant(tenant)
        except StoreBusy as exc:  # another process locks the key store: run the line again later
            err = as_api_error(exc)
            return LineOutcome(err.status, err.body(), request_id, retry=True)
        if who is None:
            err = APIError(401, "the tenant that submitted this batch no longer exists", code="invalid_api_key")
            return LineOutcome(err.status, err.body(), request_id)
        serving, _, prefix = self.routes[url]
        ctx = RequestContext(request_id=new_id(prefix), tenant=who.name)
        try:
            _, parsed, _ = self._parse(url, body)
            if self.telemetry is not None:
                operation = "chat" if url == "/v1/chat/completions" else "text_completion"
                self.telemetry.begin(ctx, operation, {}, parsed.trace_params(), request_id)
            self.gate.admit_batch_line(ctx, who)
            if self.pricer is not None:
                self.pricer.attach(ctx)
            answer = await serving.complete(parsed, ctx)
        except Exception as exc:
            err = as_api_error(exc)
            if err is None:
                ctx.status_code = 500
                raise
            ctx.status_code = err.status
            # the engine was not there (dying or restarting): not the line's fault, run it again
            retry = isinstance(exc, EngineDeadError) or err.code in ("engine_unavailable", "model_queue_full")
            return LineOutcome(err.status, err.body(), request_id, retry=retry)
        finally:
            ctx.finish()
        usage = answer.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        cost, card = Decimal(0), None
        if self.pricer is not None and usage:
            c = self.pricer.cost(usage, batch=True, model=ctx.model)
            cost, card = c.total_usd, c.card
        return LineOutcome(200, answer, request_id, input_tokens=usage.get("prompt_tokens", 0), cached_tokens=cached,
                           output_tokens=usage.get("completion_tokens", 0), cost_usd=cost, cost_card=card,
                           reasoning_tokens=(usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0))


class BatchCollector:
    """Batch API gauges for /metrics, read at scrape time."""

    def __init__(self, store: BatchStore, runner: BatchRunner):
        self.store = store
        self.runner = runner

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("tokenmill_batch_lines_inflight", "Batch lines handed to the engine now.",
                                value=self.runner.num_inflight)
        lines = CounterMetricFamily("tokenmill_batch_lines", "Batch lines ended since the server started: ok "
                                    "(output file), error (error file), rerun (cut by the engine dying).",
                                    labels=["outcome"])
        for outcome, n in self.runner.lines_finished.items():
            lines.add_metric([outcome], n)
        yield lines
        batches = GaugeMetricFamily("tokenmill_batches", "Batches in the store by status.", labels=["status"])
        for status, n in sorted(self.store.status_counts().items()):
            batches.add_metric([status], n)
        yield batches


def _tenant(raw: Request) -> Tenant:
    return raw.scope["state"]["tenant"]


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _limit(value: str | None) -> int:
    if value is None:
        return 20
    if not value.isdigit() or not 1 <= int(value) <= 10_000:
        raise APIError(400, "limit must be a whole number from 1 to 10000", param="limit")
    return int(value)


def add_batch_routes(app: FastAPI, store: BatchStore, runner: BatchRunner, limits: BatchLimits) -> None:
    app.state.metrics.registry.register(BatchCollector(store, runner))
    # Plain routes: an upload is multipart, not the JSON body the bounded route class reads.
    router = APIRouter(route_class=APIRoute)

    def not_found(kind: str, ident: str) -> APIError:
        return APIError(404, f"no {kind} with id {ident!r}", code="not_found")

    @router.post("/v1/files")
    async def upload(raw: Request) -> JSONResponse:
        ctype = raw.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise APIError(400, "upload a file as multipart/form-data with fields 'file' and 'purpose'")
        async with raw.form(max_files=1, max_fields=8) as form:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose != "batch":
                raise APIError(400, "purpose must be 'batch' (the only purpose this server stores files for)",
                               param="purpose")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "missing the file to upload", param="file")
            tmp = store.files_dir / f".upload-{uuid.uuid4().hex}"

            def copy() -> tuple[int, int]:
                size = lines = 0
                last = b"\n"
                with open(tmp, "wb") as out:
                    upload.file.seek(0)
                    for chunk in iter(lambda: upload.file.read(1 << 20), b""):
                        size += len(chunk)
                        lines += chunk.count(b"\n")
                        if size > limits.max_file_bytes:
                            raise APIError(413, f"the file exceeds {limits.max_file_bytes} bytes", param="file")
                        out.write(chunk)
                        last = chunk[-1:]
                    out.flush()
                    os.fsync(out.fileno())
                return size, lines + (last != b"\n")  # a last line without its newline

            try:
                try:
                    size, lines = await asyncio.to_thread(copy)
                except OSError as exc:  # a full disk: 507, the partial copy removed below
                    raise storage_error(exc, "the file store") from None
                if lines > limits.max_lines:
                    raise APIError(400, f"a batch file may have at most {limits.max_lines} lines, this has {lines}",
                                   param="file")
                obj = await asyncio.to_thread(store.add_file, _tenant(raw).name, upload.filename or "upload.jsonl",
                                              purpose, tmp, size, lines)
            finally:
                tmp.unlink(missing_ok=True)
        return JSONResponse(obj)

    @router.get("/v1/files")
    async def list_files(raw: Request) -> dict:
        q = raw.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order")
        data, more = store.files(_tenant(raw).name, q.get("purpose"), q.get("after"), _limit(q.get("limit")), order)
        return _page(data, more)

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, raw: Request) -> dict:
        obj = store.file(_tenant(raw).name, file_id)
        if obj is None:
            raise not_found("file", file_id)
        return obj

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, raw: Request):
        obj = store.file(_tenant(raw).name, file_id)
        if obj is None or not store.path_of(file_id).exists():
            raise not_found("file", file_id)
        return FileResponse(store.path_of(file_id), media_type="application/jsonl", filename=obj["filename"])

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, raw: Request) -> dict:
        if not await asyncio.to_thread(store.delete_file, _tenant(raw).name, file_id):
            raise not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.post("/v1/batches")
    async def create_batch(raw: Request) -> dict:
        try:
            req = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(req, dict):
            raise APIError(400, "the request body must be a JSON object")
        tenant = _tenant(raw)
        if "batch" not in tenant.limits.allowed_classes:
            raise APIError(403, "this key may not run batch requests", code="permission_denied")
        endpoint = req.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        window = req.get("completion_window", "24h")
        try:
            window_s = parse_window(window, limits.max_window_s)
        except ValueError as exc:
            raise APIError(400, str(exc), param="completion_window") from None
        metadata = req.get("metadata")
        if metadata is not None and not (
                isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
                and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                        for k, v in metadata.items())):
            raise APIError(400, f"metadata is at most {MAX_METADATA} string pairs (keys up to 64 characters, "
                                "values up to 512)", param="metadata")
        file_id = req.get("input_file_id")
        info = store.file(tenant.name, file_id) if isinstance(file_id, str) else None
        if info is None:
            raise APIError(404, f"no file with id {file_id!r}", param="input_file_id", code="not_found")
        if info["purpose"] != "batch":
            raise APIError(400, "the input file's purpose must be 'batch'", param="input_file_id")
        obj = store.create_batch(tenant.name, endpoint, file_id, window, window_s, metadata)
        runner.wake()
        return obj

    @router.get("/v1/batches")
    async def list_batches(raw: Request) -> dict:
        q = raw.query_params
        data, more = store.batches(_tenant(raw).name, q.get("after"), _limit(q.get("limit")))
        return _page(data, more)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, raw: Request) -> dict:
        obj = store.batch(_tenant(raw).name, batch_id)
        if obj is None:
            raise not_found("batch", batch_id)
        return obj

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, raw: Request) -> dict:
        obj = store.cancel(_tenant(raw).name, batch_id)
        if obj is None:
            raise not_found("batch", batch_id)
        if obj["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"a batch that is {obj['status']} cannot be cancelled", code="invalid_state")
        runner.wake()
        return obj

    app.include_router(router)

