"""Where files and batches live: one SQLite database (WAL) for metadata and the state
of every batch line, file bodies on disk beside it.

What makes a batch survive kill -9 is that each line's state changes in one
transaction: pending -> running (claimed, attempt counted) -> done (its output or
error line stored with it). A line is marked done only if it was running, so it is
done exactly once; lines left running by a crash go back to pending when the store is
opened again. The output and error files are written from the stored results when the
batch is finalized, under ids fixed by the batch's id, so finalizing twice (a crash
between writing the files and recording them) writes the same files again.

Nothing here knows HTTP or the engine; every method that names a tenant sees only
that tenant's rows, so another tenant's ids look like ids that do not exist.

This process is the database's only writer (one connection behind a mutex), so a lock
held elsewhere is another process's (a backup, an operator's shell). A call does not
wait for it (several run on the event loop, where a wait stalls every stream; with a
quarter-second wait, a locked store's retries held a 4-token chat answer 9 s): it
raises `StoreBusy` at once, the routes answer 503, the runner tries again a second
later, and nothing half-written is left (each change is one transaction). Reads go on
under another process's write lock (WAL).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from tokenmill.batch.objects import batch_obj as _batch_obj
from tokenmill.batch.objects import file_obj as _file_obj
from tokenmill.batch.storage import StoreLocked, storage_error

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL, lines INTEGER NOT NULL,
    created_at INTEGER NOT NULL, status TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS files_tenant ON files(tenant, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER NOT NULL,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0, cost_usd TEXT NOT NULL DEFAULT '0', cost_card TEXT);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches(tenant, seq);
CREATE INDEX IF NOT EXISTS batches_status ON batches(status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT NOT NULL,
    body TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
    ok INTEGER, result TEXT, PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS lines_state ON lines(batch_id, state, line);
"""


BUSY_S = 0.0  # how long a call waits for another process's lock on the database (see above)


def _busy(exc: sqlite3.OperationalError) -> Exception:
    return storage_error(exc, "the batch store")


@dataclass(frozen=True)
class Line:
    batch_id: str
    line: int  # 1-based, as in the input file
    custom_id: str
    url: str
    body: dict[str, Any]
    attempts: int


@dataclass(frozen=True)
class LineResult:
    """A line's end: `record` is its line in the output (ok) or error file."""
    ok: bool
    record: dict[str, Any]
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    cost_card: str | None = None
    reasoning_tokens: int = 0  # of output_tokens, inside thinking blocks


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _derived_id(prefix: str, *parts: object) -> str:
    return f"{prefix}-{hashlib.sha256(repr(parts).encode()).hexdigest()[:32]}"


class BatchStore:
    def __init__(self, data_dir: str | Path):
        self.root = Path(data_dir).expanduser()
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # One process owns a data directory: two runners would both think they hold the
        # running lines of the other.
        self._lock_file = open(self.root / "lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StoreLocked(f"another tokenmill process is using the data directory {self.root}") from None
        self._db = sqlite3.connect(self.root / "batch.db", timeout=BUSY_S, check_same_thread=False,
                                   isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a committed transaction survives the process being killed (the WAL is in
        # the OS's cache); only a power cut could lose the last ones.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {r["name"] for r in self._db.execute("PRAGMA table_info(batches)")}
        if "reasoning_tokens" not in columns:  # a store made before reasoning was counted
            self._db.execute("ALTER TABLE batches ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0")
        self._mu = threading.Lock()
        with self._tx():
            self._db.execute("UPDATE lines SET state = 'pending' WHERE state = 'running'")

    def close(self) -> None:
        with self._mu:
            self._db.close()
            self._lock_file.close()

    class _Tx:
        def __init__(self, store: BatchStore):
            self.store = store

        def __enter__(self):
            self.store._mu.acquire()
            try:
                self.store._db.execute("BEGIN IMMEDIATE")  # the write lock, or StoreBusy after BUSY_S
            except sqlite3.OperationalError as exc:
                self.store._mu.release()
                raise _busy(exc) from None
            return self.store._db

        def __exit__(self, exc_type, exc, tb):
            try:
                self.store._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
            except sqlite3.OperationalError as err:
                if self.store._db.in_transaction:
                    self.store._db.execute("ROLLBACK")
                raise _busy(err) from None
            finally:
                self.store._mu.release()
            if isinstance(exc, sqlite3.OperationalError) and _busy(exc) is not exc:  # (rolled back above)
                raise _busy(exc) from None
            return False

    def _tx(self) -> BatchStore._Tx:
        return BatchStore._Tx(self)

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._mu:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                raise _busy(exc) from None

    # -- files ----------------------------------------------------------------------------
    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, tenant: str, filename: str, purpose: str, src: Path, size: int, lines: int,
                 file_id: str | None = None) -> dict[str, Any]:
        """Take the file at `src` (moved, on the same filesystem) as a new file."""
        file_id = file_id or new_id("file")
        os.replace(src, self.path_of(file_id))
        now = int(time.time())
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files(id, tenant, filename, purpose, bytes, lines, created_at, status) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, 'processed')", (file_id, tenant, filename, purpose, size, lines, now))
        return self.file(tenant, file_id)

    def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
        return _file_obj(rows[0]) if rows else None

    def files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
              order: str) -> tuple[list[dict[str, Any]], bool]:
        return self._page("files", tenant, after, limit, order, ("purpose", purpose), _file_obj)

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._tx() as db:
            cur = db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
        if cur.rowcount:
            self.path_of(file_id).unlink(missing_ok=True)
        return bool(cur.rowcount)

    # -- batches --------------------------------------------------------------------------
    def create_batch(self, tenant: str, endpoint: str, input_file_id: str, completion_window: str,
                     window_s: float, metadata: dict[str, str] | None) -> dict[str, Any]:
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        with self._tx() as db:
            db.execute("INSERT INTO batches(id, tenant, endpoint, input_file_id, completion_window, status, metadata, "
                       "created_at, expires_at) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
                       (batch_id, tenant, endpoint, input_file_id, completion_window,
                        json.dumps(metadata) if metadata is not None else None, now, now + int(window_s)))
        return self.batch(tenant, batch_id)

    def batch(self, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
        if tenant is None:  # the runner's view
            rows = self._query("SELECT * FROM batches WHERE id = ?", (batch_id,))
        else:
            rows = self._query("SELECT * FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant))
        return _batch_obj(rows[0]) if rows else None

    def batch_row(self, batch_id: str) -> sqlite3.Row:
        return self._query("SELECT * FROM batches WHERE id = ?", (batch_id,))[0]

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        return self._page("batches", tenant, after, limit, "desc", None, _batch_obj)

    def batches_in(self, *statuses: str) -> list[sqlite3.Row]:
        marks = ",".join("?" * len(statuses))
        return self._query(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", statuses)

    def start(self, batch_id: str, lines: list[tuple[int, str, str, str]]) -> bool:
        """validating -> in_progress with its lines [(line, custom_id, url, body json)];
        False if the batch was cancelled meanwhile."""
        with self._tx() as db:
            cur = db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ? "
                             "WHERE id = ? AND status = 'validating'", (int(time.time()), len(lines), batch_id))
            if not cur.rowcount:
                return False
            db.executemany("INSERT INTO lines(batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                           [(batch_id, *row) for row in lines])
        return True

    def fail(self, batch_id: str, errors: list[dict[str, Any]], total: int) -> None:
        """validating -> failed, with what was wrong (no line runs)."""
        now = int(time.time())
        with self._tx() as db:
            db.execute("UPDATE batches SET status = 'failed', failed_at = ?, total = ?, errors = ? "
                       "WHERE id = ? AND status = 'validating'",
                       (now, total, json.dumps({"object": "list", "data": errors}), batch_id))

    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        """Ask for a batch to stop; a batch that has not started stops at once. Returns the
        batch (None if there is no such batch)."""
        now = int(time.time())
        with self._tx() as db:
            db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? "
                       "WHERE id = ? AND tenant = ? AND status IN ('validating', 'in_progress')", (now, batch_id, tenant))
        return self.batch(tenant, batch_id)

    def expire(self, batch_id: str) -> bool:
        """An in-progress batch whose window passed stops like a cancelled one, and ends
        'expired' (the status flag is set when it is finalized)."""
        with self._tx() as db:
            cur = db.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ?, expired_at = ? "
                             "WHERE id = ? AND status = 'in_progress'", (int(time.time()),) * 2 + (batch_id,))
        return bool(cur.rowcount)

    # -- lines ----------------------------------------------------------------------------
    def claim(self, batch_id: str, limit: int) -> list[Line]:
        """Up to `limit` pending lines, in order, marked running (one more attempt each)."""
        with self._tx() as db:
            rows = db.execute("SELECT line, custom_id, url, body, attempts FROM lines "
                              "WHERE batch_id = ? AND state = 'pending' ORDER BY line LIMIT ?",
                              (batch_id, limit)).fetchall()
            db.executemany("UPDATE lines SET state = 'running', attempts = attempts + 1 "
                           "WHERE batch_id = ? AND line = ?", [(batch_id, r["line"]) for r in rows])
        return [Line(batch_id, r["line"], r["custom_id"], r["url"], json.loads(r["body"]), r["attempts"] + 1)
                for r in rows]

    def release(self, line: Line) -> None:
        """A running line goes back to pending (it will be run again)."""
        with self._tx() as db:
            db.execute("UPDATE lines SET state = 'pending' WHERE batch_id = ? AND line = ? AND state = 'running'",
                       (line.batch_id, line.line))

    def finish(self, line: Line, result: LineResult) -> bool:
        """Record a running line's result, once; False if it was not running (already done)."""
        with self._tx() as db:
            cur = db.execute("UPDATE lines SET state = 'done', ok = ?, result = ? "
                             "WHERE batch_id = ? AND line = ? AND state = 'running'",
                             (int(result.ok), json.dumps(result.record, separators=(",", ":")), line.batch_id,
                              line.line))
            if not cur.rowcount:
                return False
            row = db.execute("SELECT cost_usd FROM batches WHERE id = ?", (line.batch_id,)).fetchone()
            db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                       "input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?, "
                       "output_tokens = output_tokens + ?, reasoning_tokens = reasoning_tokens + ?, "
                       "cost_usd = ?, cost_card = COALESCE(?, cost_card) WHERE id = ?",
                       (int(result.ok), int(not result.ok), result.input_tokens, result.cached_tokens,
                        result.output_tokens, result.reasoning_tokens, str(Decimal(row["cost_usd"]) + result.cost_usd),
                        result.cost_card, line.batch_id))
        return True

    def counts(self, batch_id: str) -> dict[str, int]:
        rows = self._query("SELECT state, COUNT(*) AS n FROM lines WHERE batch_id = ? GROUP BY state", (batch_id,))
        return {r["state"]: r["n"] for r in rows}

    # -- finalizing ------------------------------------------------------------------------
    def finalize(self, batch_id: str, not_run_code: str, not_run_message: str) -> dict[str, Any]:
        """Write the output and error files from the stored results and end the batch:
        completed (all lines done), expired or cancelled; lines that never finished go
        to the error file with `not_run_code`. Safe to run again after a crash."""
        row = self.batch_row(batch_id)
        status = row["status"]
        with self._tx() as db:
            db.execute("UPDATE batches SET finalizing_at = COALESCE(finalizing_at, ?) WHERE id = ?",
                       (int(time.time()), batch_id))
            if status == "in_progress":
                db.execute("UPDATE batches SET status = 'finalizing' WHERE id = ?", (batch_id,))
        final = ("cancelled" if status == "cancelling" or row["cancelling_at"] is not None
                 else "expired" if row["expired_at"] is not None else "completed")
        tenant = row["tenant"]
        outputs = self._write(batch_id, True, not_run_code, not_run_message)
        errors = self._write(batch_id, False, not_run_code, not_run_message)
        now = int(time.time())
        out_id = err_id = None
        with self._tx() as db:
            for ok, (tmp, size, count) in ((True, outputs), (False, errors)):
                if not count:
                    tmp.unlink(missing_ok=True)
                    continue
                fid = _derived_id("file", batch_id, "output" if ok else "error")
                os.replace(tmp, self.path_of(fid))
                db.execute("INSERT OR REPLACE INTO files(id, tenant, filename, purpose, bytes, lines, created_at, "
                           "status) VALUES (?, ?, ?, 'batch_output', ?, ?, ?, 'processed')",
                           (fid, tenant, f"{batch_id}_{'output' if ok else 'error'}.jsonl", size, count, now))
                if ok:
                    out_id = fid
                else:
                    err_id = fid
            db.execute(f"UPDATE batches SET status = ?, {final}_at = COALESCE({final}_at, ?), output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?", (final, now, out_id, err_id, batch_id))
        return self.batch(None, batch_id)

    def _write(self, batch_id: str, ok: bool, code: str, message: str) -> tuple[Path, int, int]:
        tmp = self.files_dir / f".{batch_id}.{'out' if ok else 'err'}.tmp"
        count = 0
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for line, custom_id, result in self._results(batch_id, ok):
                    if result is None:  # never finished: cancelled or expired
                        result = json.dumps({"id": _derived_id("batch_req", batch_id, line), "custom_id": custom_id,
                                             "response": None, "error": {"code": code, "message": message}},
                                            separators=(",", ":"))
                    f.write(result + "\n")
                    count += 1
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
        except OSError as exc:  # a full disk: the batch stays finalizing, written again on a later tick
            tmp.unlink(missing_ok=True)
            raise storage_error(exc, "the batch store") from None
        return tmp, size, count

    def _results(self, batch_id: str, ok: bool) -> Iterator[tuple[int, str, str | None]]:
        """(line, custom_id, stored record) of the lines for one file, in input order, a
        page at a time (a 50,000-line batch is not held in memory at once)."""
        last = 0
        cond = "state = 'done' AND ok = 1" if ok else "(state != 'done' OR ok = 0)"
        while True:
            rows = self._query(f"SELECT line, custom_id, CASE WHEN state = 'done' THEN result END AS result "
                               f"FROM lines WHERE batch_id = ? AND line > ? AND {cond} ORDER BY line LIMIT 1000",
                               (batch_id, last))
            if not rows:
                return
            for r in rows:
                yield r["line"], r["custom_id"], r["result"]
            last = rows[-1]["line"]

    def status_counts(self, tenant: str | None = None) -> dict[str, int]:
        """Batches by status: every tenant's, or one tenant's."""
        if tenant is None:
            rows = self._query("SELECT status, COUNT(*) AS n FROM batches GROUP BY status")
        else:
            rows = self._query("SELECT status, COUNT(*) AS n FROM batches WHERE tenant = ? GROUP BY status", (tenant,))
        return {r["status"]: r["n"] for r in rows}

    # -- listing --------------------------------------------------------------------------
    def _page(self, table: str, tenant: str, after: str | None, limit: int, order: str,
              where: tuple[str, Any] | None, conv) -> tuple[list[dict[str, Any]], bool]:
        sql = f"SELECT * FROM {table} WHERE tenant = ?"
        args: list[Any] = [tenant]
        if where is not None and where[1] is not None:
            sql += f" AND {where[0]} = ?"
            args.append(where[1])
        op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
        if after is not None:
            sql += f" AND seq {op} COALESCE((SELECT seq FROM {table} WHERE id = ? AND tenant = ?), " \
                   f"{'-1' if order == 'desc' else '1e18'})"
            args += [after, tenant]
        sql += f" ORDER BY seq {direction} LIMIT ?"
        args.append(limit + 1)
        rows = self._query(sql, tuple(args))
        return [conv(r) for r in rows[:limit]], len(rows) > limit
