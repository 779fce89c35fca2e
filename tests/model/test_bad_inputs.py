"""Bad model inputs give one clear line naming the problem, never a deep traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tokenmill.model.config import ModelLoadError
from tokenmill.model.loader import load_model


def _write_gguf(path, arch="llama", qtype=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c"])
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
    else:
        nbytes = gguf.GGML_QUANT_SIZES[qtype][1] * (256 // gguf.GGML_QUANT_SIZES[qtype][0])
        w.add_tensor("token_embd.weight", np.zeros((3, nbytes), dtype=np.uint8),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _error(path) -> str:
    with pytest.raises(ModelLoadError) as ei:
        load_model(str(path))
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_missing_file(tmp_path):
    assert "not found" in _error(tmp_path / "nope.gguf")


def test_truncated_gguf(tmp_path, embedded_path):
    bad = tmp_path / "trunc.gguf"
    with open(embedded_path, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    msg = _error(bad)
    assert "truncated" in msg or "corrupt" in msg


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(os.urandom(4096))
    assert "not a readable GGUF" in _error(bad)


def test_unsupported_gguf_architecture(tmp_path):
    p = tmp_path / "gpt2.gguf"
    _write_gguf(p, arch="gpt2")
    assert "unsupported GGUF architecture 'gpt2'" in _error(p)


def test_unsupported_quant_type(tmp_path):
    import gguf

    p = tmp_path / "iq.gguf"
    _write_gguf(p, qtype=gguf.GGMLQuantizationType.IQ2_XXS)
    msg = _error(p)
    assert "unsupported GGUF quantization type IQ2_XXS" in msg


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "unsupported architecture" in _error(tmp_path)


def test_cli_reports_one_line(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(100))
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "hi", "--model", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "GGUF" in lines[0]
    assert r.stdout == ""


def test_cli_generate_prints_only_generated_text(embedded_path):
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "The capital of France is",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "capital of France is" not in r.stdout
