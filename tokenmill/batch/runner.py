"""The batch runner: validates new batches, feeds their lines to the engine as the
lowest request class, and finalizes batches that are done, cancelled or expired.

It runs inside the server's event loop. How a line is validated and run is the
server's business (the same code path as a live request, so a line's answer equals
the live one); the runner is handed that as a `LineExecutor`. A line whose run was
cut by the engine dying is put back and run again; one that keeps being cut
(`max_attempts`) is failed, so a line that kills the engine cannot loop forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

from tokenmill.batch.storage import StoreBusy
from tokenmill.batch.store import BatchStore, Line, LineResult

log = logging.getLogger("tokenmill.batch")
BUSY_RETRY_S = 1.0  # how soon the runner tries a store another process has locked again


async def _settle(write, *args):
    """A line's outcome written to the store, however long another process holds its
    lock: the work is done and paid for, so it is kept rather than run again."""
    while True:
        try:
            return write(*args)
        except StoreBusy:
            await asyncio.sleep(BUSY_RETRY_S)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class BatchLimits:
    max_lines: int = 50_000
    max_file_bytes: int = 200 * 1024 * 1024
    max_inflight: int = 16  # lines handed to the engine at once (it schedules them as batch class)
    max_window_s: float = 7 * 86400.0
    max_attempts: int = 5


@dataclass
class LineOutcome:
    """What running one line gave: an HTTP status and body, as the live API would have
    answered; `retry` when the answer is only that the engine was not there."""
    status_code: int
    body: dict[str, Any]
    request_id: str
    retry: bool = False
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    cost_card: str | None = None
    reasoning_tokens: int = 0


class LineError(Exception):
    """A line that cannot run (validation): its batch fails with this in `errors`."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class LineExecutor(Protocol):
    async def validate(self, tenant: str, url: str, body: dict[str, Any]) -> None:
        """Raise LineError if the live API would refuse this body."""

    async def execute(self, tenant: str, url: str, body: dict[str, Any]) -> LineOutcome: ...


def parse_window(text: Any, max_s: float) -> float:
    """completion_window as seconds: OpenAI's "24h", or any "<n>s|m|h|d" up to the
    server's maximum (a short window is how expiry is tried)."""
    if not isinstance(text, str) or len(text) < 2 or not text[:-1].isdigit() or text[-1] not in "smhd":
        raise ValueError("completion_window must look like '24h' (a whole number of s, m, h or d)")
    seconds = int(text[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[text[-1]]
    if not 0 < seconds <= max_s:
        raise ValueError(f"completion_window must be between 1s and {int(max_s)}s")
    return float(seconds)


def parse_input(path: Path, endpoint: str, limits: BatchLimits) -> tuple[list[tuple[int, str, str, dict]],
                                                                          list[dict[str, Any]]]:
    """The input file's lines as (line, custom_id, url, body), and per-line errors for
    anything malformed: bad JSON, missing or duplicate custom_id, a method other than
    POST, a url other than the batch's endpoint."""
    lines: list[tuple[int, str, str, dict]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def err(n: int, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": n})

    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if len(lines) + len(errors) >= limits.max_lines:
                err(n, "too_many_lines", f"a batch may have at most {limits.max_lines} lines")
                break
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                err(n, "invalid_json_line", f"this line is not valid JSON: {exc}")
                continue
            if not isinstance(obj, dict):
                err(n, "invalid_json_line", "each line must be a JSON object")
                continue
            custom_id = obj.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                err(n, "missing_required_parameter", "custom_id must be a non-empty string", "custom_id")
                continue
            if custom_id in seen:
                err(n, "duplicate_custom_id", f"custom_id {custom_id[:100]!r} appears more than once", "custom_id")
                continue
            seen.add(custom_id)
            if obj.get("method") != "POST":
                err(n, "invalid_method", "method must be POST", "method")
                continue
            url = obj.get("url")
            if url != endpoint:
                code = "mismatched_endpoint" if url in ENDPOINTS else "invalid_url"
                err(n, code, f"url must be the batch's endpoint {endpoint!r}, got {url!r}", "url")
                continue
            body = obj.get("body")
            if not isinstance(body, dict):
                err(n, "missing_required_parameter", "body must be a JSON object", "body")
                continue
            lines.append((n, custom_id, url, body))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None,
                       "line": None})
    return lines, errors


class BatchRunner:
    MAX_REPORTED_ERRORS = 1000

    def __init__(self, store: BatchStore, executor: LineExecutor, limits: BatchLimits | None = None,
                 poll_s: float = 0.5):
        self.store = store
        self.executor = executor
        self.limits = limits or BatchLimits()
        self.poll_s = poll_s
        self._busy_since: float | None = None  # when the store was found locked by another process
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._inflight: dict[str, dict[int, asyncio.Task]] = {}  # batch id -> line -> task
        self._validating: dict[str, asyncio.Task] = {}
        self.lines_finished = {"ok": 0, "error": 0, "rerun": 0}  # since start, for /metrics

    @property
    def num_inflight(self) -> int:
        return sum(len(t) for t in self._inflight.values())

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = [t for lines in self._inflight.values() for t in lines.values()] + list(self._validating.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
                if self._busy_since is not None:
                    log.warning("the batch store is writable again after %.1fs", time.monotonic() - self._busy_since)
                    self._busy_since = None
            except asyncio.CancelledError:
                raise
            except StoreBusy as exc:  # another process holds the database: try again a little later
                if self._busy_since is None:
                    self._busy_since = time.monotonic()
                    log.warning("%s", exc)
                await asyncio.sleep(BUSY_RETRY_S)
            except Exception:  # a bad tick must not stop every batch for good
                log.exception("batch runner step failed")
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _tick(self) -> None:
        now = time.time()
        for row in self.store.batches_in("validating"):
            if row["id"] not in self._validating:
                self._validating[row["id"]] = asyncio.ensure_future(self._validate(row))
        for row in self.store.batches_in("in_progress"):
            if row["expires_at"] <= now:
                self.store.expire(row["id"])
        for row in self.store.batches_in("cancelling", "finalizing"):
            running = self._inflight.get(row["id"])
            if row["status"] == "cancelling" and row["id"] in self._validating:
                continue  # validation sees the cancel and stops
            if running:
                for t in running.values():
                    t.cancel()  # cancelled or expired: stop what is running (the engine aborts it)
                continue
            expired = row["expired_at"] is not None and row["cancelling_at"] is None
            code, message = (("batch_expired", "this request was not run before the batch's completion window "
                                               "ended") if expired else
                             ("batch_cancelled", "this request was not run: the batch was cancelled"))
            await asyncio.to_thread(self.store.finalize, row["id"], code, message)
        active = self.store.batches_in("in_progress")
        free = self.limits.max_inflight - self.num_inflight
        unfinished = []
        for row in active:
            if not self._inflight.get(row["id"]):
                counts = self.store.counts(row["id"])
                if not counts.get("pending") and not counts.get("running"):
                    await asyncio.to_thread(self.store.finalize, row["id"], "batch_incomplete", "not run")
                    continue
            unfinished.append(row)
        # free slots shared among the batches in progress, oldest first with the remainder
        for i, row in enumerate(unfinished):
            if free <= 0:
                break
            share = -(-free // (len(unfinished) - i))
            for line in self.store.claim(row["id"], share):
                self._inflight.setdefault(row["id"], {})[line.line] = asyncio.ensure_future(
                    self._run(row["tenant"], line))
                free -= 1

    async def _validate(self, row) -> None:
        batch_id = row["id"]
        try:
            path = self.store.path_of(row["input_file_id"])
            lines, errors = await asyncio.to_thread(parse_input, path, row["endpoint"], self.limits)
            for n, _, url, body in lines:
                if len(errors) >= self.MAX_REPORTED_ERRORS:
                    break
                if self.store.batch_row(batch_id)["status"] != "validating":
                    break  # cancelled while validating
                try:
                    await self.executor.validate(row["tenant"], url, body)
                except LineError as exc:
                    errors.append({"code": exc.code, "message": exc.message, "param": exc.param, "line": n})
            total = len(lines) + sum(1 for e in errors if e["line"] is not None and e["code"] != "too_many_lines")
            if errors:
                errors.sort(key=lambda e: (e["line"] is None, e["line"] or 0))
                self.store.fail(batch_id, errors[:self.MAX_REPORTED_ERRORS], total)
            elif not self.store.start(batch_id, [(n, cid, url, json.dumps(body)) for n, cid, url, body in lines]):
                pass  # cancelled while validating: finalized as cancelled by the next tick
        except StoreBusy as exc:  # locked or full: left validating, validated again a little later
            log.warning("validating batch %s: %s", batch_id, exc)
            await asyncio.sleep(BUSY_RETRY_S)  # (held in _validating meanwhile: no tick starts it again at once)
        except FileNotFoundError:
            self.store.fail(batch_id, [{"code": "file_not_found", "message": "the input file is gone",
                                        "param": "input_file_id", "line": None}], 0)
        except Exception:
            log.exception("validating batch %s failed", batch_id)
            self.store.fail(batch_id, [{"code": "server_error", "message": "the batch could not be validated",
                                        "param": None, "line": None}], 0)
        finally:
            self._validating.pop(batch_id, None)
            self.wake()

    async def _run(self, tenant: str, line: Line) -> None:
        try:
            try:
                outcome = await self.executor.execute(tenant, line.url, line.body)
            except asyncio.CancelledError:
                self._release(line)  # finalized as not run, or run again
                raise
            if outcome.retry and line.attempts < self.limits.max_attempts:
                # the engine is restarting: 1, 2, 4, 8 s (15 s over the attempts; a restart on a
                # loaded machine took 7 s, which the old 0.5 s steps' 5 s in all did not cover)
                await asyncio.sleep(min(8.0, 2.0 ** (line.attempts - 1)))
                await _settle(self.store.release, line)
                self.lines_finished["rerun"] += 1
                return
            result = self._result(line, outcome)
            if await _settle(self.store.finish, line, result):
                self.lines_finished["ok" if result.ok else "error"] += 1
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("batch %s line %d failed", line.batch_id, line.line)
            self._release(line)
        finally:
            lines = self._inflight.get(line.batch_id, {})
            lines.pop(line.line, None)
            if not lines:
                self._inflight.pop(line.batch_id, None)
            self.wake()

    def _release(self, line: Line) -> None:
        try:
            self.store.release(line)
        except StoreBusy as exc:  # (not waited for: a stop must not wait on another process)
            log.warning("batch %s line %d stays claimed until the store is opened again: %s", line.batch_id,
                        line.line, exc)

    @staticmethod
    def _result(line: Line, o: LineOutcome) -> LineResult:
        ok = 200 <= o.status_code < 300
        record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                  "response": {"status_code": o.status_code, "request_id": o.request_id, "body": o.body},
                  "error": None}
        return LineResult(ok, record, o.input_tokens, o.cached_tokens, o.output_tokens, o.cost_usd, o.cost_card,
                          o.reasoning_tokens)
