"""The front door: what every HTTP exchange passes before and after its route.

`Frontdoor` is the outermost ASGI middleware (streaming-safe): request ids, API keys,
body-size limits, the drain for shutdown, rate-limit headers, status counts, and the
request's settlement however the exchange ends. `bounded_route` checks a POST body's
bounded lists before FastAPI parses it. `ServerState` is the lifecycle both share with
the routes and the launcher.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.batch.storage import StoreBusy
from tokenmill.engine.api import RequestBounds
from tokenmill.server.errors import APIError, as_api_error
from tokenmill.server.gate import Gate
from tokenmill.server.key_cache import KeyCache
from tokenmill.server.keys import Tenant
from tokenmill.server.metrics import Metrics
from tokenmill.server.protocol import check_body_shape

AUTH_ERROR = "invalid or missing API key"  # one message: never say which part was wrong


class ServerState:
    """What the middleware and routes share about this server's lifecycle."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0
        self.started = time.time()
        self.on_fatal = None  # set by the launcher: exit non-zero (the engine cannot recover)


class _BodyTooLarge(StarletteHTTPException):
    """Raised while a body without a declared length is read; an HTTP exception so that
    the body parser passes it on (413) instead of calling the body malformed."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body exceeds {limit} bytes")


class Frontdoor:
    """Pure ASGI middleware (streaming-safe), outermost:
    - every response carries x-request-id (the client's own if sent) and, for a tenant
      with limits, the x-ratelimit-* headers; status codes are counted;
    - API calls need `Authorization: Bearer KEY` (or `x-api-key: KEY`) when a key store
      is configured (401; 503 store_busy when another process locks the key store and
      the key was not verified within the cache's TTL: server/key_cache.py);
    - while draining for shutdown new API requests get 503;
    - when the exchange ends, however it ends, the request's settlement runs."""

    def __init__(self, app: ASGIApp, state: ServerState, metrics: Metrics, gate: Gate,
                 keys: KeyCache | None, open_tenant: Tenant, max_body_bytes: int, upload_bytes: int | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.upload_bytes = upload_bytes  # POST /v1/files (multipart overhead included)
        self.state = state
        self.metrics = metrics
        self.gate = gate
        self.keys = keys
        self.open_tenant = open_tenant

    async def _tenant(self, scope: Scope) -> Tenant | None:
        if self.keys is None:
            return self.open_tenant
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                scheme, _, token = v.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    return await self.keys.authenticate(token.strip())
            elif k == b"x-api-key" and v.strip():  # Anthropic's clients send the key here
                return await self.keys.authenticate(v.decode("latin-1").strip())
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v.decode("latin-1")[:200] for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
        rid = rid or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["client_request_id"] = rid
        is_api = scope["path"].startswith("/v1/") or scope["path"] in ("/tokenize", "/detokenize", "/rerank")
        refusal = None
        try:
            tenant = await self._tenant(scope) if is_api else None
        except StoreBusy as exc:
            tenant, refusal = None, as_api_error(exc)
        state["tenant"] = tenant

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if not k.startswith(b"x-ratelimit-")]
                headers.append((b"x-request-id", rid.encode("latin-1")))
                ctx = state.get("ctx")
                if ctx is not None:
                    ctx.status_code = message["status"]
                    if ctx.trace is not None and ctx.trace.traceparent:
                        headers.append((b"traceparent", ctx.trace.traceparent.encode("latin-1")))
                for k, v in self.gate.headers_for(tenant).items():
                    headers.append((k.encode("latin-1"), v.encode("latin-1")))
                message["headers"] = headers
                self.metrics.responses.labels(status_code=str(message["status"])).inc()
            await send(message)

        if refusal is not None:
            await refusal.response()(scope, receive, send_wrapper)
            return
        if is_api and tenant is None:
            await APIError(401, AUTH_ERROR, code="invalid_api_key").response()(scope, receive, send_wrapper)
            return
        limit = self.max_body_bytes
        if self.upload_bytes is not None and scope["path"] == "/v1/files":
            limit = self.upload_bytes
        too_large = APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > limit):
            await too_large.response()(scope, receive, send_wrapper)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:  # a body sent without a length is counted as it comes
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_wrapper(message)
        counted = is_api and scope["method"] == "POST"
        if counted and self.state.draining:
            resp = APIError(503, "the server is shutting down", code="shutting_down").response()
            await resp(scope, receive, send_wrapper)
            return
        if counted:
            self.state.inflight += 1
        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await too_large.response()(scope, receive, send_wrapper)
        except ClientDisconnect:  # gone before its body was whole (or cut by --body-timeout): no one to answer
            pass
        finally:
            if counted:
                self.state.inflight -= 1
            ctx = state.get("ctx")
            if ctx is not None:
                ctx.finish()


def bounded_route(bounds: RequestBounds) -> type[APIRoute]:
    """A route class that checks a POST body's bounded lists before FastAPI parses it
    (protocol.check_body_shape): a million stop strings are refused in milliseconds,
    not after a second of building Python objects on the event loop."""

    class BoundedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                if request.method == "POST":
                    check_body_shape(await request.body(), bounds)  # the body is kept for the parser
                return await handler(request)

            return route

    return BoundedRoute
