"""The FastAPI app: thin routes over the serving classes, health, readiness, metrics.

`build_app(engine, config)` wires one engine client into one app; nothing is global,
so two servers can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.metrics import Metrics
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.serving import RequestContext, new_id
from tokenmill.server.serving_chat import ServingChat
from tokenmill.server.serving_completion import ServingCompletion

log = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model's own name
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish


class ServerState:
    """What the middleware and routes share about this server's lifecycle."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0
        self.started = time.time()


class RequestIdAndDrain:
    """Pure ASGI middleware (streaming-safe): every response carries x-request-id (the
    client's own if sent), status codes are counted, and while draining for shutdown
    new API requests get 503."""

    def __init__(self, app: ASGIApp, state: ServerState, metrics: Metrics):
        self.app = app
        self.state = state
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope.get("headers", []):
            if k == b"x-request-id":
                rid = v.decode("latin-1")[:200]
                break
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["client_request_id"] = rid
        is_api = scope["path"].startswith("/v1/") and scope["method"] == "POST"

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message["headers"] = headers
                self.metrics.responses.labels(status_code=str(message["status"])).inc()
            await send(message)

        if is_api and self.state.draining:
            resp = APIError(503, "the server is shutting down", code="shutting_down").response()
            await resp(scope, receive, send_wrapper)
            return
        if is_api:
            self.state.inflight += 1
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if is_api:
                self.state.inflight -= 1


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model_name = config.served_model_name or engine.model_config.name
    if engine.tokenizer is None:
        raise ValueError("the server needs a model with a tokenizer")
    state = ServerState()
    metrics = Metrics(engine.stats)
    chat = ServingChat(engine, engine.tokenizer, model_name, metrics)
    completion = ServingCompletion(engine, engine.tokenizer, model_name, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await engine.start()
        log.info("serving %s", model_name)
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.server = state
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.config = config
    install_error_handlers(app)

    def context(raw: Request, prefix: str) -> RequestContext:
        ctx = RequestContext(request_id=new_id(prefix))
        gate = getattr(app.state, "gate", None)  # tenancy, limits: installed by tokenmill.server.tenancy
        if gate is not None:
            gate.admit(raw, ctx)
        return ctx

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw, context(raw, "chatcmpl"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await completion.create(body, raw, context(raw, "cmpl"))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(state.started), "owned_by": "tokenmill",
            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "engine failed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        ok = engine.running and not state.draining
        return JSONResponse({"ready": ok, "model": model_name}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(RequestIdAndDrain, state=state, metrics=metrics)
    return app


async def drain(app: FastAPI, timeout_s: float) -> None:
    """Stop admitting, give in-flight requests `timeout_s` to finish, abort the rest."""
    state: ServerState = app.state.server
    engine: AsyncEngine = app.state.engine
    state.draining = True
    deadline = time.monotonic() + timeout_s
    while state.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.inflight:
        log.warning("shutdown deadline passed: aborting %d in-flight requests", state.inflight)
        engine.abort_all()
        end = time.monotonic() + 5.0
        while state.inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)
