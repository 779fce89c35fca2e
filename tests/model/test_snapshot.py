"""Model snapshots: the manifest changes when an input of the outputs changes, and only
then; file digests are remembered by (size, mtime, inode); ids pin."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tokenmill.config import CacheConfig, EngineConfig, ModelOptions, SchedulerConfig, SpeculativeConfig
from tokenmill.engine.api import Snapshot, SnapshotMismatch, split_snapshot_id, text_digest
from tokenmill.engine.front import generation_defaults
from tokenmill.model import snapshot as snap
from tokenmill.model.metadata import load_model_info


@pytest.fixture(scope="module")
def info(embedded_path):
    return load_model_info(embedded_path)


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def snapshot_of(info, config: EngineConfig) -> Snapshot:
    return snap.model_snapshot(config, info, generation_defaults(info.generation, config.model))


def base_config(path: str, **model) -> EngineConfig:
    return EngineConfig(model=ModelOptions(path=path, dtype="float32", quantization="none", **model))


def test_file_digest_is_the_files_sha256_remembered_by_size_mtime_and_inode(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 1000)
    root = str(tmp_path / "memo")
    d1 = snap.file_digests(str(f), root)
    assert d1 == {"m.gguf": "sha256:" + hashlib.sha256(b"a" * 1000).hexdigest()}
    st = os.stat(f)
    # the same size and mtime, same inode: remembered, not read again (this is what keeps starts fast)
    with open(f, "r+b") as fh:
        fh.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert snap.file_digests(str(f), root) == d1
    # a new mtime: hashed again
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    d2 = snap.file_digests(str(f), root)
    assert d2 == {"m.gguf": "sha256:" + hashlib.sha256(b"b" + b"a" * 999).hexdigest()}
    # replaced by a rename (another inode), same size and mtime: hashed again
    g = tmp_path / "other"
    g.write_bytes(b"c" * 1000)
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    os.replace(g, f)
    assert snap.file_digests(str(f), root) == {"m.gguf": "sha256:" + hashlib.sha256(b"c" * 1000).hexdigest()}
    # an unwritable memo costs only the hashing
    assert snap.file_digests(str(f), str(f / "nowhere")) == snap.file_digests(str(f), root)


def test_the_manifest_changes_with_each_pinned_input_and_only_then(info, embedded_path, tmp_path, monkeypatch):
    base = base_config(embedded_path)
    ref = snapshot_of(info, base)
    assert ref.id == f"{info.config.name}@sha256:{ref.digest[:12]}"
    assert snapshot_of(info, base).digest == ref.digest  # deterministic

    # inputs of the outputs: each changes the digest
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.7}))
    changed = {
        "dtype/quantization": dataclasses.replace(base, model=dataclasses.replace(
            base.model, dtype="bfloat16", quantization="int8")),
        "quantization": dataclasses.replace(base, model=dataclasses.replace(
            base.model, dtype="bfloat16", quantization="int4")),
        "kv dtype": dataclasses.replace(base, cache=CacheConfig(kv_cache_dtype="int8")),
        "block size": dataclasses.replace(base, cache=CacheConfig(block_size=32)),
        "context": dataclasses.replace(base, max_model_len=1024),
        "generation defaults": dataclasses.replace(base, model=dataclasses.replace(
            base.model, generation_config=str(gen))),
        "default max_tokens": dataclasses.replace(base, model=dataclasses.replace(base.model, default_max_tokens=64)),
    }
    digests = {k: snapshot_of(info, c).digest for k, c in changed.items()}
    assert ref.digest not in digests.values()
    assert len(set(digests.values())) == len(digests)

    # the weights' bytes: one byte changed in a copy
    copy = tmp_path / os.path.basename(embedded_path)
    shutil.copyfile(embedded_path, copy)
    assert snapshot_of(info, base_config(str(copy))).digest == ref.digest  # the same bytes elsewhere: the same
    with open(copy, "r+b") as fh:
        fh.seek(os.path.getsize(copy) - 1)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 1]))
    assert snapshot_of(info, base_config(str(copy))).digest != ref.digest

    # the chat template (a server's own replaces the model's) and the tokenizer
    assert ref.replace(chat_template=text_digest("{{ messages }}")).digest != ref.digest
    tok = info.tokenizer
    other = type(tok)(tok.hf, tok.bos_token_id, tuple(tok.eos_token_ids) + (0,), None)
    assert snap.tokenizer_digest(other) != snap.tokenizer_digest(tok)

    # tokenmill's version and the native kernels' build
    monkeypatch.setattr(snap.tokenmill, "__version__", "9.9.9")
    assert snapshot_of(info, base).digest != ref.digest
    monkeypatch.undo()
    monkeypatch.setattr("tokenmill.model.kernels.current_key", lambda: "0" * 16)
    assert snapshot_of(info, base).digest != ref.digest
    monkeypatch.undo()

    # settings that change speed, not outputs: the same snapshot
    same = [
        dataclasses.replace(base, cache=CacheConfig(kv_cache_gb=1.5, enable_prefix_caching=False)),
        dataclasses.replace(base, scheduler=SchedulerConfig(
            max_num_seqs=3, max_num_batched_tokens=64, decode_steps=1,
            speculative=SpeculativeConfig(method="ngram"))),
        dataclasses.replace(base, num_threads=1),
    ]
    for c in same:
        assert snapshot_of(info, c).digest == ref.digest
    # another name serves the same snapshot under another id
    renamed = snapshot_of(info, base_config(embedded_path, served_name="prod"))
    assert renamed.digest == ref.digest and renamed.id == f"prod@sha256:{ref.digest[:12]}"


def test_a_pin_must_name_the_snapshot_served():
    s = Snapshot("m", {"weights": {"f": "sha256:00"}})
    s.check("m")  # unpinned
    s.check(s.id)
    s.check(f"m@sha256:{s.digest}")  # the whole digest
    s.check(f"m@sha256:{s.digest[:16].upper()}")
    for bad in (f"m@sha256:{s.digest[:11]}", "m@sha256:" + "0" * 12, f"m@sha256:{s.digest[:12]}zz"):
        with pytest.raises(SnapshotMismatch) as exc:
            s.check(bad)
        assert bad in str(exc.value) and s.id in str(exc.value)
    assert split_snapshot_id("m@sha256:abc") == ("m", "abc")
    assert split_snapshot_id("m") == ("m", None)


def test_the_kernels_key_without_torch_is_the_build_plans(embedded_path):
    from tokenmill.model.kernels import current_key, plan_build

    assert current_key() == plan_build().key
    code = ("import sys\nfrom tokenmill.engine.async_engine import AsyncEngine\nfrom tokenmill.config import "
            "EngineConfig, ModelOptions\n"
            f"e = AsyncEngine.load(EngineConfig(model=ModelOptions(path={embedded_path!r})))"
            "\nassert e.served().snapshot.manifest['kernels']\n"
            "assert 'torch' not in sys.modules, 'the snapshot pulled in torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_models_show_prints_the_manifest_serve_would_run(embedded_path, info):
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "models", "show", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    shown = json.loads(out)
    expected = snapshot_of(info, base_config(None))
    assert shown["id"] == expected.id and shown["manifest"] == expected.manifest
    assert shown["digest"] == f"sha256:{expected.digest}"
