"""/v1/responses: create (plain, streamed, background), retrieve, delete, cancel.

A turn is a chat request run through app.py's `serve` (gate, limits, pricing,
telemetry); what the Responses API adds is state. With `store` (the default) the
Response object and its conversation are kept in the ResponseStore, per tenant, so
`previous_response_id` continues a conversation (its prompt is the earlier one plus
the new turn, so the prefix cache serves the earlier part) and GET/DELETE find it. A
`background` response answers at once with status `queued` and runs as a task; its
request is settled (usage, pricing, concurrency) when the task ends, not when the
HTTP exchange does, and POST .../cancel aborts it in the engine. A server without a
data directory (`--no-batch-api`) serves statelessly: `store` is reported false."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.dialects.common import renamed
from tokenmill.server.dialects.response_store import ResponseStore, StoredResponse
from tokenmill.server.dialects.responses import (RENAMES, ResponsesRequest, finish_status, input_items,
                                                 namespaces, output_items, response_object, to_chat)
from tokenmill.server.dialects.responses_stream import stream_events
from tokenmill.server.errors import APIError, as_api_error
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import RequestContext, run_until_disconnected, streaming_response
from tokenmill.server.serving_chat import ServingChat

log = logging.getLogger("tokenmill.server")


class _Turn:
    """One /v1/responses request's way back: `serve` runs the chat body through `create`."""

    def __init__(self, api: ResponsesAPI, body: ResponsesRequest, tenant: str, conversation: list[dict[str, Any]]):
        self.api = api
        self.body = body
        self.tenant = tenant
        self.conversation = conversation  # earlier turns and this one's input items
        self.stored = api.store is not None and body.store
        self.created = int(time.time())
        self.rid = ""

    def _object(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.rid, self.body, self.created, status, stored=self.stored, **kw)

    async def finish(self, output: list[dict[str, Any]], status: str, chat_usage: dict[str, Any] | None,
                     incomplete: dict | None = None, error: dict | None = None) -> dict[str, Any]:
        """The final object, stored (with the conversation it ends) when asked to be."""
        obj = self._object(status, output=output, chat_usage=chat_usage, incomplete=incomplete, error=error)
        if self.stored:
            await asyncio.to_thread(self.api.store.put, self.tenant, obj, self.conversation + output)
        return obj

    async def fail(self, output: list[dict[str, Any]], error: dict[str, Any]) -> dict[str, Any]:
        return await self.finish(output, "failed", None, error=error)

    async def create(self, chat_body: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        self.rid = ctx.request_id
        chat = self.api.chat
        try:
            if self.body.background:
                return await self._background(chat_body, raw, ctx)
            if not chat_body.stream:
                answer = await run_until_disconnected(raw, chat.complete(chat_body, ctx))
                status, incomplete = finish_status(answer["choices"][0]["finish_reason"])
                return JSONResponse(await self.finish(output_items(answer, namespaces(self.body)), status, answer["usage"], incomplete))
            chunks = await chat.open_stream(chat_body, ctx)
        except Exception as exc:  # a client's error, named as this dialect names the field
            err = renamed(exc, RENAMES)
            if err is exc:
                raise
            raise err from None
        return streaming_response(stream_events(chunks, self._object("in_progress"), self.finish, self.fail,
                                                namespaces(self.body)))

    async def _background(self, chat_body: ChatCompletionRequest, raw: Request, ctx: RequestContext) -> Response:
        work = await self.api.chat.begin(chat_body, ctx)  # refused now (400, 429), not later
        queued = self._object("queued")
        try:
            await asyncio.to_thread(self.api.store.put, self.tenant, queued, self.conversation)
        except BaseException:
            work.close()  # never started: nothing queued in the engine
            raise
        raw.scope["state"].pop("ctx", None)  # settled when the work ends, not when this exchange does
        self.api.tasks[self.rid] = asyncio.ensure_future(self._run(work, ctx))
        return JSONResponse(queued)

    async def _run(self, work: Awaitable[dict[str, Any]], ctx: RequestContext) -> None:
        try:
            await asyncio.to_thread(self.api.store.put, self.tenant, self._object("in_progress"), self.conversation)
            answer = await work
            status, incomplete = finish_status(answer["choices"][0]["finish_reason"])
            await self.finish(output_items(answer, namespaces(self.body)), status, answer["usage"], incomplete)
        except asyncio.CancelledError:
            ctx.status_code = 499
            if self.rid in self.api.cancelling:
                await self.finish([], "cancelled", ctx.usage)
            else:  # the server is stopping
                await self.fail([], {"code": "server_error", "message": "the server stopped before it finished"})
        except Exception as exc:
            err = as_api_error(exc)
            if err is None:
                log.exception("background response failed (a tokenmill bug)")
                err = APIError(500, "internal server error")
            ctx.status_code = err.status
            await self.fail([], {"code": err.code or err.type, "message": err.message})
        finally:
            if inspect.getcoroutinestate(work) == inspect.CORO_CREATED:
                work.close()  # cancelled before it began: nothing to await, nothing queued
            ctx.finish()
            self.api.tasks.pop(self.rid, None)
            self.api.cancelling.discard(self.rid)


class ResponsesAPI:
    def __init__(self, chat: ServingChat, store: ResponseStore | None):
        self.chat = chat
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}  # background responses still running
        self.cancelling: set[str] = set()

    async def get(self, tenant: str, response_id: str, param: str | None = None) -> StoredResponse:
        found = None
        if self.store is not None:
            found = await asyncio.to_thread(self.store.get, tenant, response_id)
        if found is None:
            raise APIError(404, f"no response with id {response_id!r}", param=param, code="response_not_found")
        return found

    async def stop_task(self, response_id: str) -> None:
        task = self.tasks.get(response_id)
        if task is not None:
            self.cancelling.add(response_id)
            task.cancel()
            await asyncio.wait([task])
            self.cancelling.discard(response_id)  # it may have finished on its own meanwhile

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.store is not None:
            self.store.close()


def _tenant(raw: Request) -> str:
    return raw.scope["state"]["tenant"].name


def add_responses_routes(app: FastAPI, chat: ServingChat, serve: Callable, data_dir: Path | None) -> None:
    api = ResponsesAPI(chat, ResponseStore(data_dir) if data_dir is not None else None)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI):  # background work stops (and is recorded) before the engine does
        async with inner(a) as state:
            try:
                yield state
            finally:
                await api.close()

    app.router.lifespan_context = lifespan

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, raw: Request) -> Response:
        chat.check_model(body.model)
        tenant = _tenant(raw)
        if body.background and (api.store is None or not body.store):
            raise APIError(400, "background responses need store: true (and a server with a data directory)",
                           param="background")
        if body.background and body.stream:
            raise APIError(400, "background responses cannot be streamed here; poll GET /v1/responses/{id}",
                           param="stream")
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            prev = await api.get(tenant, body.previous_response_id, "previous_response_id")
            if prev.live:
                raise APIError(400, "the previous response has not finished yet", param="previous_response_id")
            history = prev.conversation
        conversation = history + input_items(body)
        chat_body = to_chat(body, conversation, body.stream)
        return await serve(raw, chat_body, _Turn(api, body, tenant, conversation), "resp", "chat")

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, raw: Request) -> dict[str, Any]:
        return (await api.get(_tenant(raw), response_id)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, raw: Request) -> dict[str, Any]:
        await api.get(_tenant(raw), response_id)
        await api.stop_task(response_id)
        await asyncio.to_thread(api.store.delete, _tenant(raw), response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, raw: Request) -> dict[str, Any]:
        found = await api.get(_tenant(raw), response_id)
        if not found.response["background"]:
            raise APIError(400, "only background responses can be cancelled", param="response_id")
        await api.stop_task(response_id)
        return (await api.get(_tenant(raw), response_id)).response
