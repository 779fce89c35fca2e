"""Anthropic's errors and rate-limit headers for every /v1/messages response, whoever
produced it: the front door (401, 413), the gate (429), validation or the route."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    out: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id is not None:
        out["request_id"] = request_id
    return out


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class AnthropicEdge:
    """Pure ASGI middleware outside the front door, on /v1/messages paths only: every
    error leaves in Anthropic's shape (the front door's 401 and 413, the gate's 429,
    validation failures), with `request-id`; the anthropic-ratelimit-* headers come from
    the same buckets as the x-ratelimit-* ones."""

    def __init__(self, app: ASGIApp, gate: Any):
        self.app = app
        self.gate = gate

    def _headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        tenant = scope.get("state", {}).get("tenant")
        if tenant is None:
            return []
        room = self.gate.headroom(tenant)
        out = []
        for name, key in (("requests", "requests_per_minute"), ("tokens", "tokens_per_minute")):
            bucket = room.get(key)
            if bucket is not None:
                for field, value in (("limit", bucket["limit"]), ("remaining", bucket["remaining"]),
                                     ("reset", _rfc3339(time.time() + bucket["reset_s"]))):
                    out.append((f"anthropic-ratelimit-{name}-{field}".encode(), str(value).encode()))
        return out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/messages"):
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # an error's start, sent once its body is rewritten
        body = b""
        rid = None

        async def edge_send(message: Message) -> None:
            nonlocal held, body, rid
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                rid = next((v for k, v in headers if k == b"x-request-id"), None)
                headers += self._headers(scope) + ([(b"request-id", rid)] if rid else [])
                message = {**message, "headers": headers}
                if message["status"] >= 400 and any(k == b"content-type" and v.startswith(b"application/json")
                                                    for k, v in headers):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                body += message.get("body", b"")
                if message.get("more_body"):
                    return
                try:
                    text = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    text = body.decode("utf-8", "replace")
                new = json.dumps(error_body(held["status"], text, rid.decode("latin-1") if rid else None)).encode()
                headers = [(k, v) for k, v in held["headers"] if k != b"content-length"]
                await send({**held, "headers": headers + [(b"content-length", str(len(new)).encode())]})
                await send({"type": "http.response.body", "body": new})
                return
            await send(message)

        await self.app(scope, receive, edge_send)
