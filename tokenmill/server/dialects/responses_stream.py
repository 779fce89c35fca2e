"""A streamed /v1/responses answer: the chat chunks as the Responses API's semantic
events, in OpenAI's order: response.created, response.in_progress; per message item
output_item.added, content_part.added, output_text.delta..., output_text.done,
content_part.done, output_item.done; per function call output_item.added,
function_call_arguments.delta, function_call_arguments.done, output_item.done; then
response.completed (or response.incomplete). Every event carries a sequence_number.
A failure after the start is an `error` event and response.failed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tokenmill.server.dialects.responses import call_item, finish_status, item_id, message_item
from tokenmill.server.errors import APIError, as_api_error


class _Events:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_events(chunks: AsyncIterator[dict[str, Any]], start: dict[str, Any],
                        finish: Callable[..., Awaitable[dict[str, Any]]],
                        fail: Callable[..., Awaitable[dict[str, Any]]],
                        spaces: dict[str, tuple[str, str]] | None = None) -> AsyncIterator[str]:
    """`start`: the Response object in progress. `finish(output, status, chat usage,
    incomplete_details)` and `fail(output, error)` build (and store) the final object.
    `spaces`: the request's namespaced functions by flat name (responses.namespaces)."""
    ev = _Events()
    output: list[dict[str, Any]] = []
    text: list[str] = []  # the open message's text
    msg_id: str | None = None
    usage: dict[str, Any] | None = None
    reason = matched = None

    def close_message(status: str = "completed") -> list[str]:
        nonlocal msg_id
        index, whole = len(output), "".join(text)
        item = message_item(msg_id, whole, status)
        part = item["content"][0]
        out = [ev("response.output_text.done", item_id=msg_id, output_index=index, content_index=0, text=whole,
                  logprobs=[]),
               ev("response.content_part.done", item_id=msg_id, output_index=index, content_index=0, part=part),
               ev("response.output_item.done", output_index=index, item=item)]
        output.append(item)
        msg_id = None
        text.clear()
        return out

    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    try:
        first = True
        async for c in chunks:
            if first:  # the role chunk
                first = False
                continue
            if not c["choices"]:
                usage = c.get("usage") or usage
                continue
            ch = c["choices"][0]
            delta = ch["delta"].get("content")
            if delta:
                if msg_id is None:
                    msg_id = item_id("msg")
                    index = len(output)
                    item = {**message_item(msg_id, "", "in_progress"), "content": []}
                    yield ev("response.output_item.added", output_index=index, item=item)
                    yield ev("response.content_part.added", item_id=msg_id, output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                text.append(delta)
                yield ev("response.output_text.delta", item_id=msg_id, output_index=len(output), content_index=0,
                         delta=delta, logprobs=[])
            for call in ch["delta"].get("tool_calls") or []:
                for e in close_message() if msg_id is not None else []:
                    yield e
                index = len(output)
                done = call_item(call, spaces)
                yield ev("response.output_item.added", output_index=index,
                         item={**done, "arguments": "", "status": "in_progress"})
                yield ev("response.function_call_arguments.delta", item_id=done["id"], output_index=index,
                         delta=done["arguments"])
                yield ev("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                         name=done["name"], arguments=done["arguments"])
                yield ev("response.output_item.done", output_index=index, item=done)
                output.append(done)
            if ch["finish_reason"] is not None:
                reason, matched = ch["finish_reason"], ch.get("stop_reason")
        if reason == "abort" and matched == "deadline":
            raise APIError(504, "the request's deadline passed before it finished; its work was abandoned",
                           code="deadline_exceeded")
        status, incomplete = finish_status(reason)
        if msg_id is None and not output:  # an empty answer is still one (empty) message
            msg_id = item_id("msg")
            yield ev("response.output_item.added", output_index=0,
                     item={**message_item(msg_id, "", "in_progress"), "content": []})
            yield ev("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        if msg_id is not None:
            for e in close_message(status):
                yield e
        final = await finish(output, status, usage, incomplete)
        yield ev(f"response.{status}", response=final)
    except Exception as exc:  # once the stream has begun, a failure can only be told in-band
        err = as_api_error(exc)
        if err is None:
            raise
        error = {"code": err.code or err.type, "message": err.message}
        yield ev("error", code=error["code"], message=err.message, param=err.param)
        yield ev("response.failed", response=await fail(output, error))

