"""Model snapshots: a manifest of what decides a served model's outputs, built from file
metadata before any weight loads (the front process imports no torch).

The manifest holds the SHA-256 of every model file (a GGUF, or a folder's files), the
tokenizer as the server builds it, the chat template, the precision (dtype,
quantization), the KV cache's dtype and block size, the context window, the generation
defaults a silent request gets, tokenmill's version and the native kernels' build key
(tokenmill/model/kernels.py). Settings that only change speed (cache size, batch
sizes, decode bursts, speculative decoding: its output is the same) stay out, so the
snapshot changes when an input of the outputs changes, and only then.

Hashing a 1 GB file takes seconds, so a file's digest is remembered in
<cache>/snapshots/digests.json against its (size, mtime, inode), as the prepared-weights
cache (prepared.py) remembers its own: a start after the first stats the files and
hashes nothing. Its id (`NAME@sha256:<12 hex>`) and type live in the engine's seam
(tokenmill/engine/types.py `Snapshot`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

import tokenmill
from tokenmill.engine.types import GenerationDefaults, Snapshot, text_digest

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.model.metadata import ModelInfo
    from tokenmill.model.tokenizer import Tokenizer

FORMAT = 1  # bump when the manifest's layout changes (every id changes with it)
log = logging.getLogger("tokenmill.model")


def digest_root() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "tokenmill", "snapshots")


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
    return [path]


def file_digests(path: str, root: str | None = None) -> dict[str, str]:
    """{file name: "sha256:<hex>"} for a model file or each file of a folder, each digest
    remembered in <root>/digests.json against the file's (size, mtime_ns, inode): a file
    rewritten in place changes its mtime, a file replaced by a rename its inode. An
    unwritable root costs only the hashing."""
    root = root or digest_root()
    memo_path = os.path.join(root, "digests.json")
    try:
        with open(memo_path, encoding="utf-8") as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    out: dict[str, str] = {}
    changed = False
    for name in _files(path):
        st = os.stat(name)
        real = os.path.realpath(name)
        sig = [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = memo.get(real)
        if not isinstance(entry, list) or entry[:3] != sig:
            h = hashlib.sha256()
            with open(name, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            entry = memo[real] = sig + [h.hexdigest()]
            changed = True
        out[os.path.basename(name)] = f"sha256:{entry[3]}"
    if changed:
        memo = {k: v for k, v in memo.items() if os.path.exists(k)}  # files gone (a test's, a removed model)
        try:
            os.makedirs(root, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=root, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(memo, f)
            os.replace(tmp, memo_path)
        except OSError as exc:
            log.warning("could not remember model digests in %s (%s): hashing on every start", root, exc)
    return out


def tokenizer_digest(tokenizer: Tokenizer | None) -> str | None:
    """The tokenizer as the server runs it (its whole serialized form, BOS and EOS ids):
    ~20 ms for a 49K vocabulary, so it is not remembered."""
    if tokenizer is None:
        return None
    return text_digest(tokenizer.hf.to_str() + json.dumps([tokenizer.bos_token_id, list(tokenizer.eos_token_ids)]))


def template_digest(source: str | None) -> str | None:
    return None if source is None else text_digest(source)


def manifest(config: EngineConfig, info: ModelInfo, defaults: GenerationDefaults, path: str) -> dict[str, Any]:
    from tokenmill.model.kernels import current_key

    template = info.tokenizer.chat_template if info.tokenizer is not None else None
    return {
        "format": FORMAT,
        "weights": file_digests(path),
        "architecture": info.config.architecture,
        "tokenizer": tokenizer_digest(info.tokenizer),
        "chat_template": template_digest(template.source if template is not None else None),
        "precision": {"dtype": config.model.dtype, "quantization": config.model.quantization},
        "kv_cache": {"dtype": config.cache.kv_cache_dtype, "block_size": config.cache.block_size},
        "max_model_len": config.max_model_len,
        "generation_defaults": defaults.as_dict(),
        "tokenmill": tokenmill.__version__,
        "kernels": current_key() if config.native_attention else None,
    }


def model_snapshot(config: EngineConfig, info: ModelInfo, defaults: GenerationDefaults,
                   name: str | None = None) -> Snapshot:
    """The snapshot an engine serving `config` runs (`name`: what requests call it)."""
    from tokenmill.model.embedded import default_model_path

    path = config.model.path or default_model_path()
    return Snapshot(name or config.model.served_name or info.config.name, manifest(config, info, defaults, path))
