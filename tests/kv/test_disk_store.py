"""The disk tier's block files on their own: LRU within the byte cap (kept across a
restart), interrupted writes cleaned up, one store per directory."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tokenmill.kv.disk import HEADER, DiskLocked, DiskStore, identity_digest

NBYTES = 4096
IDENT = identity_digest({"model": "test"})
TOKS = tuple(range(16))
FILE = HEADER.size + 4 * len(TOKS) + NBYTES


def key(i):
    return i.to_bytes(16, "big")


def payload(i):
    return np.full(NBYTES, i % 251, dtype=np.uint8)


def store(root, files=4):
    return DiskStore(str(root), files * FILE, IDENT, NBYTES)


def test_round_trip_and_misses(tmp_path):
    s = store(tmp_path)
    assert s.write(key(1), TOKS, payload(1))
    out = np.empty(NBYTES, dtype=np.uint8)
    assert s.read(key(1), TOKS, out) and np.array_equal(out, payload(1))
    assert not s.read(key(2), TOKS, out)  # never written
    assert not s.read(key(1), tuple(range(1, 17)), out)  # other tokens under the name
    assert s.faults == {"missing": 1, "collision": 1}
    assert s.read_bytes == FILE and s.written_bytes == FILE


def test_lru_within_the_cap_and_across_a_restart(tmp_path):
    s = store(tmp_path, files=4)
    for i in range(4):
        s.write(key(i), TOKS, payload(i))
    out = np.empty(NBYTES, dtype=np.uint8)
    assert s.read(key(0), TOKS, out)  # 0 is now the most recent; 1 the least
    s.write(key(4), TOKS, payload(4))
    assert not s.contains(key(1)) and s.files_evicted == 1
    assert s.used_bytes == 4 * FILE and len(list(tmp_path.glob("blocks/*/*.kv"))) == 4
    s.close()
    # the order survives: a read refreshed 0's mtime (nanosecond stamps, set in order)
    for age, k in enumerate([2, 3, 0, 4]):
        os.utime(s.path(key(k)), ns=(10 ** 18 + age, 10 ** 18 + age))
    s = store(tmp_path, files=3)  # a smaller cap: the oldest goes at once
    assert [s.contains(key(k)) for k in (2, 3, 0, 4)] == [False, True, True, True]
    s.write(key(5), TOKS, payload(5))
    assert not s.contains(key(3)) and s.contains(key(0))


def test_interrupted_writes_are_removed_on_open(tmp_path):
    s = store(tmp_path)
    s.write(key(1), TOKS, payload(1))
    tmp = s.path(key(2)) + ".123.tmp"
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(b"half a block")
    s.close()
    s = store(tmp_path)
    assert not os.path.exists(tmp) and s.num_files == 1 and s.used_bytes == FILE


def test_a_block_larger_than_the_cap_is_not_written(tmp_path):
    s = DiskStore(str(tmp_path), FILE - 1, IDENT, NBYTES)
    assert not s.write(key(1), TOKS, payload(1)) and s.num_files == 0


def test_one_store_per_directory(tmp_path):
    s = store(tmp_path)
    with pytest.raises(DiskLocked, match=f"pid {os.getpid()}"):
        store(tmp_path)
    s.close()
    store(tmp_path).close()


def test_identity_binds_every_fact():
    base = {"weights": "w", "quantization": "none", "kv": "bf16"}
    assert identity_digest(base) == identity_digest(dict(reversed(base.items())))
    for k in base:
        assert identity_digest(dict(base, **{k: "other"})) != identity_digest(base)
