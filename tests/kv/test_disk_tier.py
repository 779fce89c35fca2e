"""The prefix cache's disk tier through the engine (tiny random model, float32): a prefix
read back from disk gives the cold run's logits bit for bit, survives a restart (under
another hash seed too), never crosses tenants, salts or models, and a bad file, a full
disk or a vanished directory costs a recompute, never a wrong answer or a crash."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_loaded
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kv.disk import DiskLocked

ROOT = Path(__file__).resolve().parents[2]
PREFIX = 62 * 16  # full blocks
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded(max_pos=2048)


def _ids(n, seed):
    return [(seed * 31 + i * 17) % 280 + 10 for i in range(n)]


PROMPT = _ids(PREFIX, 1) + _ids(9, 2)  # its tail and output stay within one block


def disk_engine(loaded, root, *, num_blocks=256, budget=PREFIX, write_through=True, kv_cache_dtype="auto"):
    cache = CacheConfig(num_blocks=num_blocks, kv_disk_dir=str(root) if root else None, kv_disk_gb=0.05,
                        kv_disk_write_through=write_through, kv_cache_dtype=kv_cache_dtype)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def run(engine, ids, params=GREEDY, rid="r", **kwargs):
    """(token ids, their logprobs and top logprobs, cached prompt tokens) of one request."""
    engine.add_request(rid, ids, params, **kwargs)
    toks, lps, cached = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            toks += out.new_token_ids
            lps += [(lp.logprob, lp.top) for lp in out.logprobs or []]
            cached = out.num_cached_tokens
    engine.kv.check_integrity()
    return toks, lps, cached


def cold(loaded, ids=PROMPT, **kw):
    """The reference: no cache anywhere; the prompt computed in chunks of PREFIX tokens, as a
    restored prefix is (its first PREFIX tokens, then the rest over them)."""
    return run(disk_engine(loaded, None, **kw), ids)


def assert_same_answer(got, ref):
    """A recompute: the same tokens; logprobs equal up to float rounding (its prefill chunks
    start elsewhere than the reference's)."""
    assert got[0] == ref[0]
    for (lp, top), (rlp, rtop) in zip(got[1], ref[1]):
        assert lp == pytest.approx(rlp, abs=1e-4) and [t for t, _ in top] == [t for t, _ in rtop]


def block_files(root):
    return sorted(Path(root, "blocks").glob("*/*.kv"))


def write_prompt(loaded, root, ids=PROMPT, kv_cache_dtype="auto", **kwargs):
    e = disk_engine(loaded, root, kv_cache_dtype=kv_cache_dtype)
    out = run(e, ids, **kwargs)
    e.close()
    return out


@pytest.mark.parametrize("kv", ["auto", "int8"])  # int8: rows and their scales
def test_restored_prefix_gives_the_cold_runs_logits_bit_for_bit(tiny, tmp_path, kv):
    first = write_prompt(tiny, tmp_path, kv_cache_dtype=kv)
    assert first[2] == 0
    e = disk_engine(tiny, tmp_path, kv_cache_dtype=kv)  # a restart: a fresh engine on the same directory
    toks, lps, cached = run(e, PROMPT)
    ref = cold(tiny, kv_cache_dtype=kv)
    assert cached == PREFIX  # every full block of the prompt (one token is always computed)
    assert (toks, lps) == ref[:2] == first[:2]  # floats compared exactly
    st = e.stats()
    assert st.kv_disk_hit_tokens == PREFIX and st.prefix_hits == PREFIX
    assert st.prompt_tokens_computed == len(PROMPT) - PREFIX
    assert st.kv_disk_restores == 1 and st.kv_disk_read_bytes > 0 and st.kv_disk_faults == 0
    # the restored bytes are the computed ones: compare with a cold engine's own blocks
    other = disk_engine(tiny, tmp_path / "other", kv_cache_dtype=kv)
    run(other, PROMPT)
    req_hashes = e.kv._chain(_Probe(PROMPT), PREFIX // 16)
    for h, toks16 in zip(req_hashes, [tuple(PROMPT[i:i + 16]) for i in range(0, PREFIX, 16)]):
        a, b = e.kv.pool.lookup(h, toks16), other.kv.pool.lookup(h, toks16)
        assert a is not None and b is not None
        ka = e.kv_cache.data[:, :, :, a * 16:(a + 1) * 16]
        kb = other.kv_cache.data[:, :, :, b * 16:(b + 1) * 16]
        assert torch.equal(ka, kb)
        if kv == "int8":
            assert torch.equal(e.kv_cache.scales[..., a * 16:(a + 1) * 16],
                               other.kv_cache.scales[..., b * 16:(b + 1) * 16])
    e.close()
    other.close()


class _Probe:
    """A request-shaped object for asking the manager a prompt's chain."""
    request_id = "probe"
    num_computed_tokens = 0
    tenant = None
    cache_salt = None

    def __init__(self, ids):
        self.ids = ids

    @property
    def num_tokens(self):
        return len(self.ids)

    def token_slice(self, start, end):
        return self.ids[start:end]


def test_evicted_blocks_are_read_back_instead_of_recomputed(tiny, tmp_path):
    """Write on eviction only: a small pool, a second prompt pushes the first one out to disk."""
    e = disk_engine(tiny, tmp_path, num_blocks=70, write_through=False)
    first = run(e, PROMPT, rid="a")
    assert block_files(tmp_path) == []  # nothing evicted yet
    run(e, _ids(PREFIX, 9) + [5], rid="b")  # needs nearly every block: evicts the first prompt's
    _drain(e)
    assert len(block_files(tmp_path)) >= 50  # (its first blocks, freed last, may stay in memory)
    toks, lps, cached = run(e, PROMPT, rid="c")
    assert cached == PREFIX and (toks, lps) == first[:2]
    assert e.stats().kv_disk_hit_tokens > 0
    e.close()


def _hash_seed_run(root, seed):
    code = ("import json, sys; sys.path.insert(0, '.');"
            "from tests.kv.test_disk_tier import tiny_loaded, write_prompt;"
            f"out = write_prompt(tiny_loaded(max_pos=2048), {str(root)!r});"
            "print(json.dumps([out[0], out[2]]))")
    env = dict(os.environ, PYTHONHASHSEED=str(seed))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_restart_under_another_hash_seed_still_hits(tmp_path):
    toks1, cached1 = _hash_seed_run(tmp_path, 1)
    toks2, cached2 = _hash_seed_run(tmp_path, 2)
    assert cached1 == 0 and cached2 == PREFIX and toks1 == toks2


def test_another_tenant_or_salt_never_hits(tiny, tmp_path):
    first = write_prompt(tiny, tmp_path, tenant="acme")
    for i, kwargs in enumerate([dict(tenant="globex"), dict(tenant="acme", cache_salt="s"), {}]):
        e = disk_engine(tiny, tmp_path)
        toks, lps, cached = run(e, PROMPT, rid=f"x{i}", **kwargs)
        assert cached == 0 and e.stats().kv_disk_hit_tokens == 0 and (toks, lps) == first[:2]
        e.close()
    e = disk_engine(tiny, tmp_path)
    assert run(e, PROMPT, tenant="acme")[2] == PREFIX
    e.close()


def test_another_model_or_precision_never_reuses_the_files(tiny, tmp_path):
    write_prompt(tiny, tmp_path)
    n = len(block_files(tmp_path))
    other = tiny_loaded(max_pos=2048, seed=1)  # other weights, same shapes and name
    for loaded, kw in [(other, {}), (tiny, dict(kv_cache_dtype="int8")), (_int8_weights(), {})]:
        e = disk_engine(loaded, tmp_path, **kw)
        toks, lps, cached = run(e, PROMPT)
        assert cached == 0 and e.stats().kv_disk_hit_tokens == 0
        assert (toks, lps) == run(disk_engine(loaded, None, **kw), PROMPT)[:2]
        e.close()
    assert len(block_files(tmp_path)) == 4 * n  # each wrote its own blocks, under other names


def _int8_weights():
    """The tiny model's weights quantized to int8 (a quantization change)."""
    from tokenmill.model.loader import LoadedModel, _expected_shapes, build_model

    t = tiny_loaded(max_pos=2048)
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=g) * (1.0 if len(shape) == 1 else 0.5)
               for name, shape in _expected_shapes(t.config).items()}
    return LoadedModel(build_model(t.config, weights, torch.float32, quantization="int8"), None, t.config, "tiny",
                       quantization="int8")


def test_a_foreign_file_under_a_blocks_name_is_a_miss(tiny, tmp_path):
    first = write_prompt(tiny, tmp_path)
    victim = _chain_files(tiny, tmp_path)[0]
    data = bytearray(victim.read_bytes())
    data[8:24] = bytes(16)  # another identity in the header
    victim.write_bytes(bytes(data))
    e = disk_engine(tiny, tmp_path)
    toks, lps, cached = run(e, PROMPT)
    assert cached == 0 and (toks, lps) == first[:2]
    assert e.kv.tier.store.faults == {"foreign": 1}
    e.close()


def _chain_files(loaded, root):
    """The prompt's block files, in chain order."""
    e = disk_engine(loaded, None)
    e.kv.model_key = _identity_key(loaded, root)
    hashes = e.kv._chain(_Probe(PROMPT), PREFIX // 16)
    files = [Path(root, "blocks", h.hex()[:2], h.hex() + ".kv") for h in hashes]
    assert all(f.exists() for f in files)
    return files


def _identity_key(loaded, root):
    e = disk_engine(loaded, Path(root) / "probe")
    key = e.kv.model_key
    e.close()
    return key


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_file_ends_the_restore_there(tiny, tmp_path, damage):
    first = write_prompt(tiny, tmp_path)
    victim = _chain_files(tiny, tmp_path)[10]
    data = bytearray(victim.read_bytes())
    if damage == "corrupt":
        data[-100] ^= 0x40
    else:
        del data[len(data) // 2:]
    victim.write_bytes(bytes(data))
    e = disk_engine(tiny, tmp_path)
    toks, lps, cached = run(e, PROMPT)
    assert cached == 10 * 16  # the blocks before the damaged one
    assert_same_answer((toks, lps), first)
    assert e.kv.tier.store.faults == {damage: 1} and e.stats().kv_disk_faults == 1
    e.close()
    assert victim.exists()  # rewritten whole by the recompute (write-through)
    e = disk_engine(tiny, tmp_path)
    assert run(e, PROMPT)[2] == PREFIX
    e.close()


def test_a_full_disk_costs_only_the_writes(tiny, tmp_path, caplog):
    e = disk_engine(tiny, tmp_path)

    def enospc(path, parts):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    e.kv.tier.store._write_file = enospc
    toks, lps, cached = run(e, PROMPT)
    e.kv.tier.close()
    assert (toks, lps) == cold(tiny)[:2]
    assert e.kv.tier.store.faults["nospace"] == PREFIX // 16  # every full block
    assert block_files(tmp_path) == [] and not list(Path(tmp_path, "blocks").glob("*/*.tmp"))
    assert "nospace" in caplog.text  # logged (once a minute per kind)


def test_a_directory_deleted_while_serving(tiny, tmp_path):
    root = tmp_path / "kv"
    e = disk_engine(tiny, root, num_blocks=70)
    first = run(e, PROMPT, rid="a")
    _drain(e)
    run(e, _ids(PREFIX, 9) + [5], rid="b")  # the first prompt's blocks leave memory
    _drain(e)
    shutil.rmtree(root)
    toks, lps, cached = run(e, PROMPT, rid="c")  # the index still lists them: every read fails
    assert_same_answer((toks, lps), first)
    assert cached < PREFIX  # (the first blocks, freed last, may still be in memory)
    assert e.kv.tier.store.faults.get("missing", 0) >= 1
    _drain(e)
    assert len(block_files(root)) > 0  # writes recreated the folders
    e.close()


def _drain(e):
    """Wait for the tier's pending writes."""
    tier = e.kv.tier
    for _ in range(500):
        if not tier._pending:
            return
        threading.Event().wait(0.01)
    raise AssertionError("writes still pending")


def test_one_server_per_directory(tiny, tmp_path):
    e = disk_engine(tiny, tmp_path)
    with pytest.raises(DiskLocked, match="another tokenmill server"):
        disk_engine(tiny, tmp_path)
    e.close()
    disk_engine(tiny, tmp_path).close()


def test_a_restore_does_not_stall_other_streams(tiny, tmp_path):
    write_prompt(tiny, tmp_path)
    e = disk_engine(tiny, tmp_path)
    gate = threading.Event()
    read = e.kv.tier.store.read

    def slow_read(*args):
        gate.wait(30)
        return read(*args)

    e.kv.tier.store.read = slow_read
    e.add_request("stream", _ids(30, 5), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    e.add_request("back", PROMPT, GREEDY)
    assert e.kv.restoring(e.scheduler.requests["back"])
    for _ in range(6):  # the stream gets tokens every step while the restore waits on its read
        assert any(o.request_id == "stream" and o.new_token_ids for o in e.step())
    assert e.kv.restoring(e.scheduler.requests["back"])
    gate.set()
    cached = None
    while e.has_unfinished():
        for o in e.step():
            if o.request_id == "back":
                cached = o.num_cached_tokens
    assert cached == PREFIX
    e.close()
