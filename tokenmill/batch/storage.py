"""A server's data directory (the Batch API's files and batches, stored responses, the
capture store, API keys): one per server, found by port, and the errors a write under it
can meet (another process's lock, a full disk), as the routes and the batch runner read
them."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path


class StoreLocked(RuntimeError):
    """Another process holds this data directory."""


class StoreBusy(RuntimeError):
    """Another process holds a database's lock (past the caller's wait): try again later."""


class StoreFull(StoreBusy):
    """The disk under the data directory is full: nothing was written (each change is one
    transaction; a file is written beside its final name and moved into place), so what
    was stored stays whole. Try again once there is room; the batch runner does, as it
    does for a busy store."""


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: a file-size limit (RLIMIT_FSIZE, quotas)


def storage_error(exc: BaseException, what: str) -> BaseException:
    """`exc` from a write under the data directory as StoreBusy or StoreFull where it is
    one of those (SQLite reports a full disk as SQLITE_FULL, "database or disk is full"),
    else `exc` itself."""
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text):
        return StoreBusy(f"{what}'s database is locked by another process ({text}); retry shortly")
    full = (isinstance(exc, sqlite3.OperationalError) and "disk is full" in text) or (
        isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS)
    if full:
        return StoreFull(f"{what} cannot write: the disk under the data directory is full ({text}); nothing was "
                         "stored, retry once there is room")
    return exc


def default_data_dir(port: int) -> Path:
    """One server's own directory under the user's data directory (XDG), by port, so
    two servers on one machine do not share (and lock each other out of) one store."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "tokenmill" / f"server-{port}"
