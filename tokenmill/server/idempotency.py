"""Idempotency-Key: a retried non-streaming request returns the stored response
instead of generating again. Bounded (LRU) with a TTL; a key reused with a different
body is refused (422); a retry that arrives while the first is still running waits
for it, so the engine generates once."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import Response

from tokenmill.server.errors import APIError


@dataclass
class _Entry:
    fingerprint: str
    created: float
    done: asyncio.Future  # -> (status, body bytes, media type)


class IdempotencyStore:
    def __init__(self, max_entries: int = 10_000, ttl_s: float = 24 * 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self.replays = 0

    def _prune(self) -> None:
        now = self.clock()
        while self._entries:
            key, e = next(iter(self._entries.items()))
            if now - e.created > self.ttl_s or len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            else:
                break

    async def run(self, scope: str, key: str, fingerprint: str,
                  produce: Callable[[], Awaitable[Response]]) -> Response:
        self._prune()
        k = (scope, key)
        entry = self._entries.get(k)
        if entry is not None:
            if entry.fingerprint != fingerprint:
                raise APIError(422, "this Idempotency-Key was used with a different request body",
                               param="Idempotency-Key", code="idempotency_key_reused")
            status, body, media = await asyncio.shield(entry.done)
            self.replays += 1
            return Response(body, status_code=status, media_type=media, headers={"idempotent-replayed": "true"})
        entry = _Entry(fingerprint, self.clock(), asyncio.get_running_loop().create_future())
        self._entries[k] = entry
        try:
            resp = await produce()
        except BaseException as exc:
            # Nothing to replay: let a retry run afresh, and fail any waiter the same way.
            self._entries.pop(k, None)
            if not entry.done.done():
                entry.done.set_exception(exc if isinstance(exc, Exception) else APIError(499, "cancelled"))
                entry.done.exception()  # retrieved: no "never retrieved" warning
            raise
        entry.done.set_result((resp.status_code, bytes(resp.body), resp.media_type))
        return resp
