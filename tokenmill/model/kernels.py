"""Native kernels, compiled on first use with torch's C++ extension builder.

The build (about 40 s on two cores) is cached on disk by torch and shared between
processes (a file lock serializes concurrent builds). If it cannot be built, callers
fall back to the pure-torch path and say so once in the log.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Any

log = logging.getLogger("tokenmill.model")
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")


@lru_cache(maxsize=None)  # one build per process; a compiled module is like an import
def paged_attention_ext() -> Any | None:
    try:
        from torch.utils.cpp_extension import load

        return load(name="tokenmill_paged_attention", sources=[os.path.join(_CSRC, "paged_attention.cpp")],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: run without it
        log.warning("native paged attention unavailable, using the torch path: %s", str(exc).splitlines()[0])
        return None
