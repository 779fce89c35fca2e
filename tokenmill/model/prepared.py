"""Prepared weights on disk, so that a start after the first skips the preparation.

Loading a quantized model dequantizes the file's blocks, requantizes and repacks them
for the native kernels: ~2 s of a 135M model's start on two cores, the same every time.
The built model (LlamaModel with its packed weights) is saved once with torch.save and
mapped by later starts (0.3 s instead of 2.2 for the embedded model), its packed
weights then copied onto huge pages as a fresh build places them and their mapped pages
let go (tokenmill.model.memory.drop_mapped_pages: kept, they stayed resident beside the
copy, +50 to +135 MB); the rest is read from the page cache as it is first used, so a
start reads no bytes it does not need (Qwen2.5-Coder's 700 MB file: ~0.4 s).

The file is keyed by what decides its contents: the model's bytes (a digest, remembered
per path, size, mtime and inode so a start does not rehash 100 MB), the dtype and
quantization, the model package's sources (a code change invalidates it), torch's
version, whether the VNNI kernels are used, and FORMAT. Anything unreadable is rebuilt.
The directory is $TOKENMILL_PREPARED_DIR (`off` disables the cache), else
$XDG_CACHE_HOME/tokenmill/prepared (~/.cache by default).

Old entries go: a file's name starts with its slot (the model's bytes, dtype,
quantization, VNNI), and saving keeps the KEEP_PER_SLOT entries of that slot used most
recently (a hit refreshes its mtime), deleting the others, which a code or torch change
made unreachable. Two, not one: a developer comparing two trees (or two installs sharing
a cache) would otherwise prepare on every start. Names from before slots can never be
hit again and go on the next save. Without this a developer's cache held 12 GB of
stale copies of a few models after a day's work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Any

import torch

FORMAT = 1
KEEP_PER_SLOT = 2
_SOURCES = ("llama.py", "quant.py", "loader.py", "memory.py", "attention.py", "config.py", "gguf_loader.py",
            "safetensors_loader.py", "prepared.py")
log = logging.getLogger("tokenmill.model")


def prepared_root() -> str | None:
    root = os.environ.get("TOKENMILL_PREPARED_DIR")
    if root:
        return None if root == "off" else os.path.abspath(os.path.expanduser(root))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "tokenmill", "prepared")


def model_digest(path: str, root: str) -> str:
    """A digest of the model's bytes (a file, or a folder's files): the snapshot's file
    digests (tokenmill/model/snapshot.py), remembered in <root>/digests.json."""
    from tokenmill.model.snapshot import file_digests

    outer = hashlib.sha256()
    for name, digest in sorted(file_digests(path, root).items()):
        outer.update(name.encode() + b"\0" + digest.encode())
    return outer.hexdigest()


def _sources_digest() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in _SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def cache_file(path: str, dtype: torch.dtype, quantization: str, vnni: bool) -> str | None:
    """Where this model's prepared weights live (whether or not they exist yet); None when
    the cache is off or its directory cannot be made."""
    root = prepared_root()
    if root is None:
        return None
    try:
        os.makedirs(root, exist_ok=True)
        facts = {"model": model_digest(path, root), "dtype": str(dtype), "quantization": quantization,
                 "vnni": vnni, "sources": _sources_digest(), "torch": torch.__version__, "format": FORMAT}
    except OSError as exc:
        log.warning("prepared-weights cache unavailable (%s): preparing every start", exc)
        return None
    slot_facts = {k: facts[k] for k in ("model", "dtype", "quantization", "vnni")}
    slot = hashlib.sha256(json.dumps(slot_facts, sort_keys=True).encode()).hexdigest()[:12]
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(root, f"{slot}-{key}.pt")


def load(file: str) -> Any | None:
    """The saved model, memory-mapped; None if missing or unreadable (then removed)."""
    if not os.path.exists(file):
        return None
    try:
        model = torch.load(file, mmap=True, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: prepare again
        log.warning("prepared weights %s unreadable (%s: %s): preparing again", file, type(exc).__name__, exc)
        try:
            os.remove(file)
        except OSError:
            pass
        return None
    try:
        os.utime(file)  # used now: the last entry of its slot to be evicted
    except OSError:  # a read-only cache still serves
        pass
    return model


def save(model: Any, file: str) -> None:
    """Write atomically (a concurrent start sees the old state or the whole file); a
    failure to write costs only the next start's time."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(model, f)
        os.replace(tmp, file)
    except OSError as exc:
        log.warning("could not save prepared weights to %s: %s", file, exc)
        return
    evict(file)


def evict(file: str) -> list[str]:
    """Delete the entries of file's slot beyond the KEEP_PER_SLOT used last (file, just
    saved, among those kept), entries named before slots, and interrupted saves' temporary
    files older than an hour; returns what went. A start that still maps a deleted file
    keeps its pages (the inode lives until unmapped)."""
    root, name = os.path.split(file)
    slot = name.split("-", 1)[0]
    mine, gone = [], []
    stale = time.time() - 3600
    for entry in os.scandir(root):
        when = _mtime(entry)
        if when is None:  # gone meanwhile
            continue
        stem = entry.name[:-3] if entry.name.endswith(".pt") else ""
        if len(stem) == 20 and "-" not in stem:  # a name from before slots
            gone.append(entry.path)
        elif entry.name.endswith(".tmp") and when < stale:  # an interrupted save's
            gone.append(entry.path)
        elif stem.startswith(slot + "-"):
            mine.append((when, entry.path))
    mine.sort(reverse=True)
    gone += [path for _, path in mine[KEEP_PER_SLOT:] if path != file]
    removed = []
    for path in gone:
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    if removed:
        log.info("prepared weights: removed %d older entr%s", len(removed), "y" if len(removed) == 1 else "ies")
    return removed


def _mtime(entry: os.DirEntry) -> float | None:
    try:
        return entry.stat().st_mtime
    except OSError:
        return None

