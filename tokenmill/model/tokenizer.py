"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face folder.

The GGUF path rebuilds a `tokenizers` byte-level BPE from the vocabulary, merges
and token types in the file, the same way transformers does, so ids agree; Gemma's
sentencepiece vocabulary (tokenizer.ggml.model "llama") becomes a BPE with byte fallback
whose merges are recovered from the vocabulary's order, as transformers' GGUF loader
recovers them.
"""

from __future__ import annotations

import copy
import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from tokenmill.model.config import ModelConfig, ModelLoadError

# Pre-tokenizer split patterns for the `tokenizer.ggml.pre` values whose merges were
# learned on something other than GPT-2's default split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4
# sentencepiece vocabularies we rebuild, by the file's architecture
_SENTENCEPIECE_ARCHITECTURES = {"gemma", "gemma2", "gemma3"}
_SPACE = "\u2581"  # sentencepiece's visible space


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ChatTemplate:
    """A Jinja chat template rendered the way transformers renders it."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.template = env.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


class Tokenizer:
    """Text <-> token ids, special tokens, and the chat template of one model."""

    def __init__(self, hf: HFTokenizer, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None):
        self.hf = hf  # its post-processor decides whether encode() adds BOS
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            tid for tid, tok in hf.get_added_tokens_decoder().items() if tok.special
        )
        self.chat_template = self._compile(chat_template) if chat_template else None

    # -- encoding / decoding -------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for logprobs' `bytes`)."""
        tok = self.hf.id_to_token(token_id) or ""
        inverse = {c: b for b, c in _byte_alphabet().items()}
        if all(c in inverse for c in tok):
            return bytes(inverse[c] for c in tok)
        return tok.encode("utf-8")

    def with_chat_template(self, source: str) -> "Tokenizer":
        """This tokenizer with another chat template (a server's `--chat-template`); the
        template is compiled here, so a broken one fails at start, not on a request."""
        twin = copy.copy(self)
        twin.chat_template = self._compile(source)
        return twin

    def _compile(self, source: str) -> ChatTemplate:
        """A chat template whose bos_token and eos_token are this vocabulary's."""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return ChatTemplate(source, *(self.hf.id_to_token(t) if t is not None else None
                                      for t in (self.bos_token_id, eos)))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use the completions endpoint")
        return self.chat_template.render(messages, add_generation_prompt, tools, **kwargs)

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any]) -> "Tokenizer":
        kind = md.get("tokenizer.ggml.model")
        if kind == "llama" and md.get("general.architecture") in _SENTENCEPIECE_ARCHITECTURES:
            return cls._from_gguf_sentencepiece(md)
        if kind != "gpt2":
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
                f"'llama' (sentencepiece) for {sorted(_SENTENCEPIECE_ARCHITECTURES)}"
            )
        tokens: list[str] = list(md["tokenizer.ggml.tokens"])
        types: list[int] = list(md.get("tokenizer.ggml.token_type") or [])
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
        alphabet = _byte_alphabet()
        chars = set(alphabet.values())
        vocab = {}
        for i, tok in enumerate(tokens):
            if not set(tok) <= chars:  # stored as plain text: respell in the byte alphabet
                tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)
        hf = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        split = PRE_TOKENIZER_SPLITS.get(md.get("tokenizer.ggml.pre", ""))
        if split is None:
            hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        hf.decoder = decoders.ByteLevel()
        bos_id = md.get("tokenizer.ggml.bos_token_id")
        if md.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
            bos = tokens[bos_id]
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= chars]
        if control:
            hf.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
        if user:
            hf.add_tokens(user)
        eos = [md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.eot_token_id")]
        return cls(
            hf,
            bos_token_id=bos_id,
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            chat_template=md.get("tokenizer.chat_template"),
        )

    @classmethod
    def _from_gguf_sentencepiece(cls, md: dict[str, Any]) -> "Tokenizer":
        """Gemma's vocabulary as transformers' GGUF loader builds it (GemmaTokenizer): a
        BPE with byte fallback over text whose spaces are the visible space. Gemma files
        store a token of two or more spaces as real spaces (respelled here) and list no
        merges: they come from the vocabulary, the earlier token merging first."""
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in md["tokenizer.ggml.tokens"]]
        types: list[int] = list(md.get("tokenizer.ggml.token_type") or [])
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = ([tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]] if md.get("tokenizer.ggml.merges")
                  else merges_from_vocabulary(vocab))
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        hf = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                             unk_token=tokens[unk_id] if unk_id is not None else None))
        hf.normalizer = normalizers.Replace(" ", _SPACE)
        hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        hf.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        bos_id = md.get("tokenizer.ggml.bos_token_id")
        # (a sentencepiece file that does not say adds BOS, as llama.cpp and transformers do)
        if md.get("tokenizer.ggml.add_bos_token", True) and bos_id is not None:
            bos = tokens[bos_id]
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == _CONTROL]
        if control:
            hf.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        if user:
            hf.add_tokens(user)
        eos = [md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.eot_token_id")]
        return cls(hf, bos_token_id=bos_id, eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
                   chat_template=md.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_folder(cls, folder: str, cfg: ModelConfig) -> "Tokenizer | None":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            return None  # weights-only checkpoints (tests) run on token ids
        hf = HFTokenizer.from_file(path)
        tc: dict[str, Any] = {}
        tc_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(tc_path):
            with open(tc_path, encoding="utf-8") as f:
                tc = json.load(f)
        template = tc.get("chat_template")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()

        def token_id(key: str) -> int | None:
            tok = tc.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return hf.token_to_id(tok) if tok else None

        bos = token_id("bos_token") if token_id("bos_token") is not None else cfg.bos_token_id
        eos = token_id("eos_token")
        eos_ids = tuple(dict.fromkeys(([eos] if eos is not None else []) + list(cfg.eos_token_ids)))
        return cls(hf, bos, eos_ids, template)


def merges_from_vocabulary(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges a vocabulary implies when its order is its merge order (Gemma's): each
    token's splits into two tokens, the earlier token's first and the longer left part
    first. transformers' generate_merges with each token's score its -index gives the
    same list (its sort on (score, left length) spelled out: ~2x faster on 262k tokens)."""
    merges = []
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        for i in range(len(token) - 1, 0, -1):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges
