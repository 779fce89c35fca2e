"""Tokenizer, chat template and incremental detokenizer against transformers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.model.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello, world! This is a plain English sentence.",
    "def add(a, b):\n\treturn a + b  # sum\n\n\nclass Foo:\n    pass\n",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "   leading spaces, runs     of    spaces\n\n\n\nand newlines\r\n\ttabs",
    "Numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "Ünïcödé àccents — em dash “quotes” ‘single’ …",
    "",
    " ",
    "{\"json\": [1, 2, {\"k\": null}], \"s\": \"a\\nb\"}",
]


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_transformers(smol, hf_tokenizer, text):
    ours = smol.tokenizer.encode(text)
    ref = hf_tokenizer(text)["input_ids"]
    assert ours == ref
    assert smol.tokenizer.decode(ours, skip_special_tokens=False) == text


CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "No system message here."}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "多语言 🎉"},
     {"role": "assistant", "content": "ok"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smol, hf_tokenizer, messages, add_generation_prompt):
    ours = smol.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
    assert ours == ref


def _stream(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[1, 2, 3])
    deltas = [detok.add(t) for t in ids]
    return deltas, detok.finish()


@pytest.mark.parametrize("text", CORPUS[:8])
def test_incremental_detokenizer_equals_full_decode(smol, text):
    tok = smol.tokenizer
    ids = tok.encode(text)
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    for d in deltas:
        assert "\ufffd" not in d


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=17, max_value=49151), min_size=1, max_size=24))
def test_detokenizer_never_drops_text_on_random_tokens(smol, ids):
    tok = smol.tokenizer
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)


def test_detokenizer_holds_half_characters(smol):
    tok = smol.tokenizer
    # byte-level tokens for the 4 bytes of one emoji, one token per byte
    ids = [tok.hf.token_to_id(c) for c in "ðŁİī"]  # U+1F389 in GPT-2's byte alphabet
    assert all(i is not None for i in ids)
    deltas, tail = _stream(tok, ids)
    assert deltas[:3] == ["", "", ""]
    assert deltas[3] == "🎉" and tail == ""
    # cut short: the partial character is not emitted mid-stream but not lost at the end
    deltas, tail = _stream(tok, ids[:2])
    assert deltas == ["", ""] and tail == tok.decode(ids[:2])


def test_our_gguf_reader_reads_what_gguf_py_reads(embedded_path):
    """tokenmill.model.gguf_reader (fast) against gguf-py's GGUFReader (the reference)."""
    import gguf
    import numpy as np

    from tokenmill.model.gguf_reader import GGUFReader

    ours, ref = GGUFReader(embedded_path), gguf.GGUFReader(embedded_path, "r")
    meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(meta)
    for k, v in meta.items():
        assert ours.metadata[k] == v and type(ours.metadata[k]) is type(v), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.shape, a.tensor_type, a.data_offset, a.n_bytes) == (
            tuple(int(x) for x in b.shape), b.tensor_type, b.data_offset, b.n_bytes), a.name
        ref_data = np.asarray(b.data)
        assert a.data.dtype == ref_data.dtype and a.data.shape == ref_data.shape, a.name
        assert np.array_equal(a.data, ref_data), a.name
