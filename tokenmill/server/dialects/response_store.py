"""Stored responses (/v1/responses with `store: true`): one SQLite database (WAL) in the
Batch API's data directory, which that store's lock already gives one process.

A row holds the response object as the client sees it and the conversation it ends
(the input items of every turn up to it and its output items, instructions excepted:
OpenAI does not carry those over), so `previous_response_id` continues from one row.
Every method names a tenant and sees only that tenant's rows: another tenant's id reads
as one that does not exist. Rows expire `retention_s` after they were written; expired
rows are never returned and are deleted as new ones are written. Background responses
left queued or running by a process that stopped are marked failed when the store opens.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.batch.storage import storage_error

RETENTION_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at REAL NOT NULL,
    status TEXT NOT NULL, background INTEGER NOT NULL, response TEXT NOT NULL, conversation TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses(expires_at);
"""
LIVE = ("queued", "in_progress")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]

    @property
    def live(self) -> bool:
        return self.response["status"] in LIVE


class ResponseStore:
    def __init__(self, data_dir: str | Path, retention_s: float = RETENTION_S):
        if not retention_s > 0:
            raise ValueError("retention_s must be positive")
        self.retention_s = retention_s
        self._db = sqlite3.connect(Path(data_dir) / "responses.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._mu = threading.Lock()
        self._fail_interrupted()

    def close(self) -> None:
        with self._mu:
            self._db.close()

    def _fail_interrupted(self) -> None:
        error = {"code": "server_error", "message": "the server stopped before this response finished"}
        with self._mu:
            rows = self._db.execute(f"SELECT id, response FROM responses WHERE status IN {LIVE}").fetchall()
            for rid, text in rows:
                obj = {**json.loads(text), "status": "failed", "error": error}
                self._db.execute("UPDATE responses SET status = 'failed', response = ? WHERE id = ?",
                                 (json.dumps(obj), rid))

    def put(self, tenant: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Write (or rewrite: a background response's later states) one response."""
        now = time.time()
        with self._mu:
            try:
                self._db.execute("DELETE FROM responses WHERE expires_at < ?", (now,))
                self._db.execute(
                    "INSERT INTO responses (id, tenant, created_at, expires_at, status, background, response, "
                    "conversation) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                    "status = excluded.status, response = excluded.response, conversation = excluded.conversation "
                    "WHERE tenant = excluded.tenant",
                    (response["id"], tenant, response["created_at"], now + self.retention_s, response["status"],
                     int(bool(response.get("background"))), json.dumps(response), json.dumps(conversation)))
            except sqlite3.OperationalError as exc:  # a full disk (507) or a lock held elsewhere (503)
                raise storage_error(exc, "the response store") from None

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._mu:
            row = self._db.execute("SELECT response, conversation FROM responses WHERE id = ? AND tenant = ? "
                                   "AND expires_at >= ?", (response_id, tenant, time.time())).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._mu:
            cur = self._db.execute("DELETE FROM responses WHERE id = ? AND tenant = ? AND expires_at >= ?",
                                   (response_id, tenant, time.time()))
        return cur.rowcount > 0
