"""Request capture, for exact replay (`tokenmill replay`, tokenmill/server/replay.py).

Opt-in (`serve --capture all`, or `--capture keys` for the keys added with `tokenmill
keys add --capture`): each finished live request's model snapshot id, its resolved
parameters (ResolvedParams: every default applied, the seed included), its prompt
token ids and each choice's output token ids go to one SQLite database (WAL), by
default `captures.db` in the server's data directory, created readable by its owner
only. No text is stored (token ids only) and nothing of a capture reaches logs,
traces or the console. Rows older than the retention limit and, beyond the size cap,
the oldest rows are deleted as new ones are written.

A sampled request without a seed gets one drawn here (the engine would draw one
anyway: the output's distribution is the same), so that its replay is exact too.
Requests that did not finish (aborted, cut by a deadline, failed) are not stored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.api import RequestOutput, ResolvedParams

log = logging.getLogger("tokenmill.server")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS captures (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL,
    created_at REAL NOT NULL, operation TEXT NOT NULL, snapshot TEXT NOT NULL,
    params TEXT NOT NULL, prompts TEXT NOT NULL, outputs TEXT NOT NULL, finish TEXT NOT NULL,
    bytes INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS captures_created ON captures(created_at);
"""
CAPTURE_MODES = ("off", "all", "keys")
_PRUNE_EVERY_S = 60.0


@dataclass(frozen=True)
class Captured:
    """One stored request. `outputs[p][i]`: the token ids of choice i of prompt p."""
    id: str
    tenant: str
    created_at: float
    operation: str  # chat or text_completion
    snapshot: str  # the snapshot id that answered it
    params: dict[str, Any]  # ResolvedParams as JSON (params_json)
    prompts: list[list[int]]
    outputs: list[list[list[int]]]
    finish: list[list[str]]


def params_json(params: ResolvedParams) -> dict[str, Any]:
    """ResolvedParams as JSON values (logit_bias keys as strings, tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(params)))


class CaptureStore:
    """The captures database. Thread-safe; every method is a short transaction."""

    def __init__(self, path: str, retention_s: float = 7 * 86400, max_bytes: int = 512 * 10 ** 6, *,
                 read_only: bool = False):
        """`read_only` (`tokenmill replay`): nothing is pruned, so the server's own
        retention and size cap alone decide what is kept."""
        if retention_s <= 0 or max_bytes <= 0:
            raise ValueError("the capture retention and size cap must be positive")
        self.path, self.retention_s, self.max_bytes = path, retention_s, max_bytes
        self._lock = threading.Lock()
        self._bytes = 0
        if read_only:
            self._db = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True, check_same_thread=False)
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))  # created private (token ids decode to text)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._pruned = 0.0
        self.prune()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add(self, c: Captured) -> None:
        fields = (json.dumps(c.params, separators=(",", ":")), json.dumps(c.prompts, separators=(",", ":")),
                  json.dumps(c.outputs, separators=(",", ":")), json.dumps(c.finish, separators=(",", ":")))
        size = sum(len(f) for f in fields)
        with self._lock:
            self._db.execute(
                "INSERT INTO captures(id, tenant, created_at, operation, snapshot, params, prompts, outputs, finish,"
                " bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (c.id, c.tenant, c.created_at, c.operation, c.snapshot, *fields, size))
            self._bytes += size
        if self._bytes > self.max_bytes or time.monotonic() - self._pruned > _PRUNE_EVERY_S:
            self.prune()

    def prune(self, now: float | None = None) -> int:
        """Delete rows past the retention limit, then the oldest while over the size cap;
        returns how many went."""
        now = time.time() if now is None else now
        with self._lock:
            self._pruned = time.monotonic()
            gone = self._db.execute("DELETE FROM captures WHERE created_at < ?", (now - self.retention_s,)).rowcount
            self._bytes = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM captures").fetchone()[0]
            if self._bytes > self.max_bytes:
                over, cut = self._bytes - self.max_bytes, None
                for seq, size in self._db.execute("SELECT seq, bytes FROM captures ORDER BY seq"):
                    over, cut = over - size, seq
                    if over <= 0:
                        break
                gone += self._db.execute("DELETE FROM captures WHERE seq <= ?", (cut,)).rowcount
                self._bytes = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM captures").fetchone()[0]
        return gone

    def get(self, capture_id: str) -> Captured | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, tenant, created_at, operation, snapshot, params, prompts, outputs, finish FROM captures "
                "WHERE id = ?", (capture_id,)).fetchone()
        if row is None:
            return None
        return Captured(*row[:5], *(json.loads(x) for x in row[5:]))

    def ids(self, limit: int = 100) -> list[str]:
        """The most recent captures' ids, newest first."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT id FROM captures ORDER BY seq DESC LIMIT ?", (limit,))]

    @property
    def size_bytes(self) -> int:
        return self._bytes


@dataclass
class CapturePolicy:
    """Whose requests are captured: everyone's (`all`) or the keys flagged for it (`keys`)."""
    store: CaptureStore
    mode: str = "all"

    def wants(self, tenant: Any) -> bool:
        return self.mode == "all" or (self.mode == "keys" and bool(getattr(tenant.limits, "capture", False)))


class Recording:
    """One request being captured: `start` with its resolved parameters, `prompt` for each
    engine request it makes, `observe` every output, `finish` (a RequestContext
    finalizer) stores it if every choice finished."""

    def __init__(self, store: CaptureStore, request_id: str, tenant: str, operation: str):
        self.store, self.request_id, self.tenant, self.operation = store, request_id, tenant, operation
        self.snapshot = ""
        self.params: ResolvedParams | None = None
        self._prompts: dict[str, int] = {}  # engine request id -> prompt index
        self._ids: list[list[int]] = []
        self._outputs: dict[tuple[int, int], list[int]] = {}
        self._finish: dict[tuple[int, int], str] = {}

    def start(self, params: ResolvedParams, snapshot: str) -> ResolvedParams:
        """The parameters to run: a sampled request without a seed gets one, stored with it."""
        if not params.greedy and params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        self.params, self.snapshot = params, snapshot
        return params

    def prompt(self, engine_request_id: str, ids: list[int]) -> None:
        self._prompts[engine_request_id] = len(self._ids)
        self._ids.append(list(ids))

    def observe(self, out: RequestOutput) -> None:
        p = self._prompts.get(out.request_id)
        if p is None:
            return
        self._outputs.setdefault((p, out.index), []).extend(out.new_token_ids)
        if out.finished:
            self._finish[(p, out.index)] = out.finish_reason or ""

    def finish(self, usage: Any = None) -> None:
        if self.params is None or not self._ids:
            return
        n = self.params.n
        keys = [(p, i) for p in range(len(self._ids)) for i in range(n)]
        if any(self._finish.get(k) not in ("stop", "length") for k in keys):
            return  # aborted, cut short or failed: nothing a replay could match
        try:
            self._store()
        except (sqlite3.Error, OSError) as exc:  # capture is a record: its failure fails no request
            log.warning("could not store capture %s: %s", self.request_id, exc)

    def _store(self) -> None:
        n = self.params.n
        self.store.add(Captured(
            id=self.request_id, tenant=self.tenant, created_at=time.time(), operation=self.operation,
            snapshot=self.snapshot, params=params_json(self.params), prompts=self._ids,
            outputs=[[self._outputs.get((p, i), []) for i in range(n)] for p in range(len(self._ids))],
            finish=[[self._finish[(p, i)] for i in range(n)] for p in range(len(self._ids))]))
