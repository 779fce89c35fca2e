"""Block files of the prefix cache's disk tier: full KV blocks kept on disk, named by their
prefix-chain hash (tokenmill/kv/manager.py), so a prompt's prefix outlives the memory
pool, a restart and a deploy. Pure files and numpy; the threads that move blocks between
these files and the KV cache are in tokenmill/kv/tier.py.

One file per block, DIR/blocks/<2 hex>/<hash hex>.kv:

    header   magic, identity (16 bytes), hash (16), tokens (n), payload bytes, crc32
    tokens   n uint32, little-endian
    payload  the block's K/V bytes, as KVCache.read_block lays them out

The identity (`identity_digest`) binds what decides the bytes' meaning: the model
snapshot (weights), quantization, dtypes, the KV layout, block size, the native kernels
and this format's version. It is also the root of the hash chain, so another model's
blocks have other names; the header check is the second guard. A file that is short,
long, of another identity, of other tokens or fails its checksum is a miss (counted,
logged, and deleted when it is ours), never an error or a wrong answer.

LRU within a byte cap: a read refreshes the file's mtime, so the order survives a restart.
One server per directory: DIR/lock is held (flock) while the store is open.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict

import numpy as np

log = logging.getLogger("tokenmill.kv.disk")

FORMAT_VERSION = 1
MAGIC = b"TMKVBLK1"
# magic, identity, block hash, number of tokens, payload bytes, crc32 of tokens + payload
HEADER = struct.Struct("<8s16s16sIQI")
SUFFIX = ".kv"
_LOG_EVERY_S = 60.0  # a fault of one kind is logged at most this often (a vanished dir fails every write)


class DiskLocked(RuntimeError):
    """Another process (or engine) has this KV disk directory open."""


def identity_digest(identity: dict) -> bytes:
    """16 bytes naming what a block's bytes mean (see the module docstring)."""
    facts = dict(identity, format=FORMAT_VERSION)
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).digest()


def pack_tokens(token_ids) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


class DiskStore:
    """Content-addressed block files under `root`, at most `capacity_bytes` of them (LRU).

    `contains` may be called from any thread; `read` from one thread, `write` from one
    (another or the same)."""

    def __init__(self, root: str, capacity_bytes: int, identity: bytes, payload_nbytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the KV disk tier needs a positive size, got {capacity_bytes} bytes")
        self.root = os.path.abspath(root)
        self.capacity_bytes = int(capacity_bytes)
        self.identity = identity
        self.payload_nbytes = payload_nbytes
        self.blocks_dir = os.path.join(self.root, "blocks")
        os.makedirs(self.blocks_dir, exist_ok=True)
        self._lock_file = self._take_lock()
        self._mu = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recent first
        self.used_bytes = 0
        self.read_bytes = 0
        self.written_bytes = 0
        self.files_written = 0
        self.files_evicted = 0
        self.faults: dict[str, int] = {}  # kind -> count (see _fault)
        self.num_faults = 0
        self._logged: dict[str, float] = {}
        self._scan()

    # -- opening ------------------------------------------------------------------------
    def _take_lock(self):
        path = os.path.join(self.root, "lock")
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise DiskLocked(f"another tokenmill server (pid {holder}) is using the KV disk directory "
                             f"{self.root}; give each server its own --kv-disk-dir") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return f

    def _scan(self) -> None:
        """Index the files already here, least recently used first; drop interrupted writes."""
        found = []
        for sub in os.scandir(self.blocks_dir):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                try:
                    if name.endswith(".tmp"):  # a write cut short (crash, kill)
                        os.unlink(entry.path)
                        continue
                    if not name.endswith(SUFFIX):
                        continue
                    key = bytes.fromhex(name[:-len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self.used_bytes += size
        self._make_room(0)  # a smaller cap than last time

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    # -- queries ------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._index  # (a dict lookup is atomic under the GIL)

    @property
    def num_files(self) -> int:
        return len(self._index)

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.blocks_dir, h[:2], h + SUFFIX)

    # -- faults -------------------------------------------------------------------------
    def _fault(self, kind: str, key: bytes, detail: object = "", drop: bool = True) -> bool:
        """Count (and now and then log) a fault; a bad file is deleted. Returns False (a miss)."""
        with self._mu:  # (read by the engine thread)
            self.faults[kind] = self.faults.get(kind, 0) + 1
            self.num_faults += 1
        now = time.monotonic()
        if now - self._logged.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[kind] = now
            log.warning("KV disk tier: %s block %s in %s (%s); recomputed instead (%d %s faults so far)",
                        kind, key.hex()[:12], self.root, detail, self.faults[kind], kind)
        if drop:
            self._forget(key, unlink=True)
        return False

    def _forget(self, key: bytes, unlink: bool) -> None:
        with self._mu:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
        if unlink:
            try:
                os.unlink(self.path(key))
            except OSError:
                pass

    # -- reading ------------------------------------------------------------------------
    def read(self, key: bytes, token_ids, out: np.ndarray) -> bool:
        """Fill `out` (uint8, payload_nbytes) with block `key`'s payload if its file is
        whole, ours and of these tokens; False (a miss) otherwise."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                if len(head) < HEADER.size:
                    return self._fault("truncated", key, f"{len(head)}-byte header")
                magic, ident, k, ntok, nbytes, crc = HEADER.unpack(head)
                if magic != MAGIC or ident != self.identity or k != key:
                    return self._fault("foreign", key, "another model, format or name")
                if ntok != len(token_ids) or nbytes != out.nbytes:
                    return self._fault("foreign", key, f"{ntok} tokens, {nbytes} bytes")
                toks = f.read(4 * ntok)
                got = f.readinto(memoryview(out))
                if len(toks) < 4 * ntok or got < nbytes:
                    return self._fault("truncated", key, f"{HEADER.size + len(toks) + (got or 0)} bytes")
                if f.read(1):
                    return self._fault("corrupt", key, "longer than its header says")
        except FileNotFoundError:
            self._forget(key, unlink=False)
            return self._fault("missing", key, "file gone", drop=False)
        except OSError as exc:
            return self._fault("io", key, exc, drop=False)
        if zlib.crc32(out, zlib.crc32(toks)) != crc:
            return self._fault("corrupt", key, "checksum mismatch")
        if toks != pack_tokens(token_ids):
            return self._fault("collision", key, "other tokens under this hash", drop=False)
        with self._mu:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(path)  # recency for the LRU order after a restart
        except OSError:
            pass
        self.read_bytes += HEADER.size + len(toks) + nbytes
        return True

    # -- writing ------------------------------------------------------------------------
    def write(self, key: bytes, token_ids, payload: np.ndarray) -> bool:
        """Store block `key` (atomically: a temporary file renamed into place). False on a
        fault (no space, I/O): counted, and the block stays memory-only."""
        if key in self._index:
            return True
        toks = pack_tokens(token_ids)
        crc = zlib.crc32(payload, zlib.crc32(toks))
        size = HEADER.size + len(toks) + payload.nbytes
        if size > self.capacity_bytes:
            return False
        self._make_room(size)
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.tmp"
        for attempt in (0, 1):
            try:
                self._write_file(tmp, (HEADER.pack(MAGIC, self.identity, key, len(token_ids), payload.nbytes, crc),
                                       toks, memoryview(payload)))
                os.replace(tmp, path)
                break
            except FileNotFoundError as exc:  # its folder, or the whole directory, was removed
                if attempt:
                    return self._write_fault("io", key, exc, tmp)
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                except OSError as exc2:
                    return self._write_fault("io", key, exc2, tmp)
            except OSError as exc:
                return self._write_fault("nospace" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io",
                                         key, exc, tmp)
        with self._mu:
            self._index[key] = size
            self.used_bytes += size
        self.written_bytes += size
        self.files_written += 1
        return True

    @staticmethod
    def _write_file(path: str, parts) -> None:
        with open(path, "wb") as f:
            for part in parts:
                f.write(part)

    def _write_fault(self, kind: str, key: bytes, exc: OSError, tmp: str) -> bool:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return self._fault(kind, key, exc, drop=False)

    def _make_room(self, size: int) -> None:
        """Delete least recently used files until `size` more bytes fit under the cap."""
        while self.used_bytes + size > self.capacity_bytes and self._index:
            with self._mu:
                key, old = self._index.popitem(last=False)
                self.used_bytes -= old
            try:
                os.unlink(self.path(key))
            except OSError:
                pass
            self.files_evicted += 1
