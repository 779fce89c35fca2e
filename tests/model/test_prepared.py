"""The prepared-weights cache (tokenmill/model/prepared.py): a quantized model is
prepared once, announced on stderr, and later loads map the saved result, which computes
exactly what a fresh preparation does."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.engine.api import SamplingParams
from tokenmill.engine.llm import LLM
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.model.loader import load_model


def _greedy(loaded, prompt):
    llm = LLM(loaded, config=EngineConfig(cache=CacheConfig(kv_cache_gb=0.05)))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm.generate([prompt, prompt[:5]], sp)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_PREPARED_DIR", str(tmp_path))
    return tmp_path


def test_prepared_once_then_mapped_with_the_same_outputs(embedded_path, cache_dir, capfd):
    first = load_model(embedded_path, "bfloat16", "int4")
    err = capfd.readouterr().err
    assert "preparing SmolLM2-135M-Instruct.Q4_1.gguf" in err and "prepared in" in err
    files = [f for f in os.listdir(cache_dir) if f.endswith(".pt")]
    assert len(files) == 1
    second = load_model(embedded_path, "bfloat16", "int4")
    assert "preparing" not in capfd.readouterr().err
    prompt = second.tokenizer.encode("The capital of France is")
    a, b = _greedy(first, prompt), _greedy(second, prompt)
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    for x, y in zip(first.model.linears(), second.model.linears()):
        assert torch.equal(x.tiles, y.tiles)
    # a touched file with the same bytes is a hit; another quantization another entry
    if os.access(embedded_path, os.W_OK):
        os.utime(embedded_path)
    load_model(embedded_path, "bfloat16", "int4")
    assert "preparing" not in capfd.readouterr().err
    load_model(embedded_path, "bfloat16", "int8")
    assert "preparing" in capfd.readouterr().err
    assert len([f for f in os.listdir(cache_dir) if f.endswith(".pt")]) == 2


def test_an_unreadable_cache_file_is_prepared_again(embedded_path, cache_dir, capfd):
    load_model(embedded_path, "bfloat16", "int4")
    (path,) = [cache_dir / f for f in os.listdir(cache_dir) if f.endswith(".pt")]
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    capfd.readouterr()
    loaded = load_model(embedded_path, "bfloat16", "int4")
    assert "preparing" in capfd.readouterr().err
    prompt = loaded.tokenizer.encode("Hello")
    assert len(_greedy(loaded, prompt)[0].outputs[0].token_ids) == 12


def test_off_writes_nothing_and_dense_models_are_not_cached(embedded_path, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TOKENMILL_PREPARED_DIR", "off")
    load_model(embedded_path, "bfloat16", "int4")
    assert "preparing" not in capfd.readouterr().err
    monkeypatch.setenv("TOKENMILL_PREPARED_DIR", str(tmp_path))
    load_model(embedded_path, "float32")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".pt")]


def test_auto_keeps_the_files_blocks(embedded_path, cache_dir):
    """`auto` (the CLI's default) runs a Q8_0 file as int8 and a 4-bit or float one as int4,
    resolved before the prepared weights' cache key."""
    from tokenmill.model.loader import file_quantization

    loaded = load_model(embedded_path, "bfloat16", "auto")
    assert loaded.quantization == "int4"  # the embedded file's layers are Q4_1
    assert {t for n, t in loaded.gguf_qtypes.items() if n.startswith("blk.") and "norm" not in n} >= {"Q4_1"}
    q8 = {f"blk.{i}.{x}.weight": "Q8_0" for i in range(2) for x in ("attn_q", "ffn_up")}
    assert file_quantization({**q8, "blk.0.attn_norm.weight": "F32", "token_embd.weight": "Q8_0"}) == "int8"
    assert file_quantization({"blk.0.attn_q.weight": "F16", "blk.0.ffn_up.weight": "F16"}) == "int4"
    assert file_quantization(None) == "int4"  # a Hugging Face folder
    # resolved before the cache key: `auto` and `int4` share one prepared file
    from tokenmill.model import prepared
    from tokenmill.model.quant import quant_vnni_available

    assert os.path.exists(prepared.cache_file(embedded_path, torch.bfloat16, "int4", quant_vnni_available()))


def test_mapped_pages_let_go_after_the_copy_read_back_the_same(tmp_path):
    """The prepared file is mapped; the packed weights' pages, once copied out, are let go
    (tokenmill.model.memory.drop_mapped_pages): this process's resident file pages drop,
    and the tensor still reads the file's bytes."""
    from tokenmill.model.memory import drop_mapped_pages

    def rss_file_kb() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))

    t = torch.arange(16 << 20, dtype=torch.int32)  # 64 MiB
    path = tmp_path / "t.pt"
    torch.save({"t": t}, path)
    mapped = torch.load(path, mmap=True)["t"]
    assert torch.equal(mapped, t)  # every page touched
    before = rss_file_kb()
    drop_mapped_pages([mapped])
    assert before - rss_file_kb() > 48 << 10
    assert torch.equal(mapped, t)


def test_a_slot_keeps_its_two_entries_used_last(tmp_path, monkeypatch):
    """Entries of the same model and settings made by other code versions are deleted
    on save, but for the one used last besides the new one; other slots stay, and names
    from before slots go."""
    import time

    from tokenmill.model import prepared

    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("TOKENMILL_PREPARED_DIR", str(root))
    model, other = tmp_path / "m.gguf", tmp_path / "o.gguf"
    model.write_bytes(b"m" * 100)
    other.write_bytes(b"o" * 100)
    legacy = root / ("0" * 20 + ".pt")
    legacy.write_bytes(b"from before slots")
    past = time.time_ns() - 10**12

    def saved(version, path=model, quantization="int4"):
        nonlocal past
        monkeypatch.setattr(prepared, "_sources_digest", lambda: version)
        file = prepared.cache_file(str(path), torch.bfloat16, quantization, True)
        prepared.save({"version": version}, file)
        past += 10**9  # mtimes a second apart: the order does not hang on the clock's grain
        os.utime(file, ns=(past, past))
        return file

    v1 = saved("v1")
    assert not legacy.exists()
    keep = [saved("v1", quantization="int8"), saved("v1", path=other)]
    v2 = saved("v2")
    assert os.path.exists(v1) and os.path.exists(v2)  # two per slot
    assert prepared.load(v1) == {"version": "v1"}  # a hit: v1 is now the slot's most recent
    v3 = saved("v3")
    assert sorted(os.listdir(root)) == sorted(os.path.basename(f) for f in [v1, v3, *keep] + ["digests.json"])
    assert not os.path.exists(v2)


def test_a_read_only_cache_still_serves_and_interrupted_saves_go(tmp_path, monkeypatch):
    import time

    from tokenmill.model import prepared

    monkeypatch.setenv("TOKENMILL_PREPARED_DIR", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"m" * 100)
    file = prepared.cache_file(str(model), torch.bfloat16, "int4", True)
    old_tmp, new_tmp = tmp_path / "a.tmp", tmp_path / "b.tmp"
    for path, age in ((old_tmp, 7200), (new_tmp, 60)):
        path.write_bytes(b"partial")
        os.utime(path, (time.time() - age, time.time() - age))
    prepared.save({"x": 1}, file)
    assert not old_tmp.exists() and new_tmp.exists()  # a save in progress elsewhere is left alone

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(prepared.os, "utime", refuse)
    assert prepared.load(file) == {"x": 1} and os.path.exists(file)
