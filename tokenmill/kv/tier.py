"""The disk tier under the prefix cache: background threads that move whole blocks between
the KV cache and the block files of tokenmill/kv/disk.py, off the step loop.

The KV manager calls it at three points (tokenmill/kv/manager.py):
  save     a full, cached block is evicted from memory (or, with write-through, has just
           been computed): its bytes are copied now (the block is about to be reused) and
           written in the background;
  restore  a request's prefix misses memory but its next blocks are on disk: they are read
           into freshly allocated blocks in the background, and the request waits (other
           requests keep stepping) until `completed` hands the restore back;
  close    pending writes are flushed, and the directory's lock is released.

Reads and writes have a thread each (a read never waits behind writes; the writer runs
at a lower priority than the step). They use numpy and file I/O only, never torch: a torch op on a second thread would
start a second OpenMP team beside the step's (see tokenmill/engine/async_engine.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.kv.cache import KVCache
from tokenmill.kv.disk import DiskStore, identity_digest

log = logging.getLogger("tokenmill.kv.disk")

MAX_PENDING_BYTES = 256 * 1024 ** 2  # snapshots waiting to be written; beyond this, a save is dropped
WRITER_NICE = 10  # the writer thread's nice value (Linux: per thread)
SPARE_BUFFERS = 64  # written snapshots' buffers kept for the next saves
CLOSE_FLUSH_S = 30.0  # how long close() waits for pending writes


@dataclass
class Restore:
    """One request's prefix being read back: block_ids[i] gets keys[i]'s block. The reader
    sets num_loaded (the first num_loaded blocks are filled) and then done."""
    request_id: str
    keys: list[bytes]
    tokens: list[tuple[int, ...]]
    block_ids: list[int]
    pinned: list[int]  # the request's memory hits, held so that they outlive the read
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0
    num_loaded: int = 0
    done: bool = False


@dataclass
class TierStats:
    lookup_tokens: int = 0  # prompt tokens in full blocks that memory lacked, looked up on disk
    hit_tokens: int = 0  # of those, read back from disk
    restores: int = 0
    restore_seconds: float = 0.0  # summed over restores: start to the blocks ready
    dropped_saves: int = 0  # saves refused because too many writes were pending


def weights_id(path: str, tensors) -> str:
    """The model snapshot's name: its file(s) by path, size and modification time, or, for a
    model built in memory (tests), a digest of its tensors."""
    if os.path.isfile(path):
        st = os.stat(path)
        return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    if os.path.isdir(path):
        parts = []
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                parts.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
        return f"{os.path.realpath(path)}/[{','.join(parts)}]"
    h = hashlib.blake2b(digest_size=16)
    for t in tensors():
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return f"{path}:tensors:{h.hexdigest()}"


def _model_tensors(model):
    """The tensors of a model built in memory (dense linears: tests build these)."""
    yield model.embed
    yield model.norm
    for layer in model.layers:
        yield layer.input_norm
        yield layer.post_norm
        for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            for name in ("weight", "bias"):
                t = getattr(lin, name, None)
                if isinstance(t, torch.Tensor):
                    yield t


def open_disk_tier(cache_config, loaded, cache: KVCache, kernels: str) -> DiskTier:
    """The tier for `serve --kv-disk-dir`: its files bound to this model snapshot (a
    tokenmill.model.loader.LoadedModel), precision, KV layout and kernels (`kernels`: the
    native module's build name and the attention path)."""
    import tokenmill

    identity = {
        "weights": weights_id(loaded.path, lambda: _model_tensors(loaded.model)),
        "quantization": loaded.quantization,
        "dtype": str(loaded.model.dtype),
        "kv": cache.layout,
        "block_size": cache.block_size,
        "kernels": kernels,
        "code": tokenmill.__version__,
    }
    return DiskTier(cache_config.kv_disk_dir, int(cache_config.kv_disk_gb * 1024 ** 3), identity, cache,
                    cache_config.kv_disk_write_through)


class DiskTier:
    def __init__(self, root: str, capacity_bytes: int, identity: dict, cache: KVCache,
                 write_through: bool = True, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.cache = cache
        self.key = identity_digest(identity)  # also the root of the prefix hash chain
        self.nbytes = cache.block_nbytes
        self.store = DiskStore(root, capacity_bytes, self.key, self.nbytes)
        self.write_through = write_through
        self.max_pending_bytes = max_pending_bytes
        self.stats = TierStats()
        self._cv = threading.Condition()
        self._pending: dict[bytes, tuple[tuple[int, ...], np.ndarray]] = {}  # saved, not yet written
        self._spare: list[np.ndarray] = []  # snapshot buffers free for reuse
        self._writes: deque[bytes] = deque()
        self._reads: deque[Restore] = deque()
        self._done: list[Restore] = []
        self._closing = False
        # reads and writes on threads of their own: a read never waits behind writes
        self._threads = [threading.Thread(target=self._read_loop, name="tokenmill-kv-disk-read", daemon=True),
                         threading.Thread(target=self._write_loop, name="tokenmill-kv-disk-write", daemon=True)]
        for t in self._threads:
            t.start()
        log.info("KV disk tier: %s, %.2f of %.2f GiB used (%d blocks)", self.store.root,
                 self.store.used_bytes / 1024 ** 3, capacity_bytes / 1024 ** 3, self.store.num_files)

    # -- the engine thread ----------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        return key in self._pending or self.store.contains(key)

    def save(self, key: bytes, token_ids: tuple[int, ...], block_id: int) -> None:
        """Keep block `block_id` (named `key`) on disk: copied now, written in the background."""
        if self._closing or self.has(key):
            return
        if len(self._pending) * self.nbytes >= self.max_pending_bytes:
            self.stats.dropped_saves += 1
            return
        # a written snapshot's buffer again: a fresh one's first touch (page faults) cost 10x the copy
        snap = self._spare.pop() if self._spare else np.empty(self.nbytes, dtype=np.uint8)
        self.cache.read_block(block_id, snap)
        with self._cv:
            self._pending[key] = (token_ids, snap)
            self._writes.append(key)
            self._cv.notify_all()  # (the reader and the writer wait on it)

    def restore(self, request_id: str, keys: list[bytes], tokens: list[tuple[int, ...]],
                block_ids: list[int], pinned: list[int]) -> Restore:
        """Read blocks `keys` into `block_ids` in the background; `completed` returns the
        Restore when it is done."""
        r = Restore(request_id, keys, tokens, block_ids, pinned)
        with self._cv:
            self._reads.append(r)
            self._cv.notify_all()  # (the reader and the writer wait on it)
        return r

    def completed(self) -> list[Restore]:
        if not self._done:
            return []
        with self._cv:
            done, self._done = self._done, []
        for r in done:
            self.stats.restores += 1
            self.stats.restore_seconds += r.finished - r.started
        return done

    def wait(self, timeout: float) -> None:
        """Block until a restore completes or `timeout` seconds pass."""
        with self._cv:
            if not self._done:
                self._cv.wait(timeout)

    def engine_stats(self) -> dict:
        """The tier's part of EngineStats."""
        st, store = self.stats, self.store
        return dict(kv_disk_lookup_tokens=st.lookup_tokens, kv_disk_hit_tokens=st.hit_tokens,
                    kv_disk_read_bytes=store.read_bytes, kv_disk_written_bytes=store.written_bytes,
                    kv_disk_restores=st.restores, kv_disk_restore_seconds=st.restore_seconds,
                    kv_disk_used_bytes=store.used_bytes, kv_disk_capacity_bytes=store.capacity_bytes,
                    kv_disk_files=store.num_files, kv_disk_faults=store.num_faults)

    def close(self) -> None:
        """Flush pending writes (for at most CLOSE_FLUSH_S), stop the threads, release the dir."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        deadline = time.monotonic() + CLOSE_FLUSH_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.store.close()

    # -- the reader and the writer ---------------------------------------------------------
    def _read_loop(self) -> None:
        buf = np.empty(self.nbytes, dtype=np.uint8)
        while True:
            with self._cv:
                while not (self._reads or self._closing):
                    self._cv.wait()
                if not self._reads:
                    return
                r = self._reads.popleft()
            try:
                n = 0 if self._closing else self._load(r, buf)
            except Exception:  # a bug here must not leave a request waiting forever
                log.exception("KV disk tier reader")
                n = 0
            with self._cv:
                r.num_loaded = n
                r.done, r.finished = True, time.monotonic()
                self._done.append(r)
                self._cv.notify_all()

    def _load(self, r: Restore, buf: np.ndarray) -> int:
        """Fill r's blocks in order; how many, up to the first that is not whole."""
        for i, (key, toks, bid) in enumerate(zip(r.keys, r.tokens, r.block_ids)):
            with self._cv:  # (a written snapshot's buffer is reused: copy it before the writer lets it go)
                pending = self._pending.get(key)
                if pending is not None and pending[0] == toks:  # saved moments ago, not yet written
                    self.cache.write_block(bid, pending[1])
                    continue
            if not self.store.read(key, toks, buf):
                return i
            self.cache.write_block(bid, buf)
        return len(r.keys)

    def _write_loop(self) -> None:
        try:  # below the step's threads: on two cores a write must not take a decode step's time
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cv:
                while not (self._writes or self._closing):
                    self._cv.wait()
                if not self._writes:
                    return  # closing, and every pending write done
                key = self._writes.popleft()
            try:
                self._write(key)
            except Exception:
                log.exception("KV disk tier writer")

    def _write(self, key: bytes) -> None:
        toks, snap = self._pending[key]
        try:
            self.store.write(key, toks, snap)
        finally:
            with self._cv:
                del self._pending[key]
            if len(self._spare) < SPARE_BUFFERS:
                self._spare.append(snap)
