"""Native kernels (tokenmill/model/csrc), compiled on first use with torch's C++
extension builder: paged attention that reads the KV cache through block tables, and
the small fused ops of a decode step (add + rms_norm, rotary embedding).

The build (one to two minutes on two cores) is cached on disk by torch and shared between
processes (a file lock serializes concurrent builds). If it cannot be built, callers
fall back to the pure-torch path and say so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from typing import Any

log = logging.getLogger("tokenmill.model")
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp", "quant_gemv.cpp", "decode_step.cpp")
HEAD_DIMS = (64, 80, 96, 128)  # the head sizes paged_attention is instantiated for


def native_ops_for(head_dim: int) -> Any | None:
    """The native module if it is built and supports this model's head size."""
    return native_ops() if head_dim in HEAD_DIMS else None


@lru_cache(maxsize=None)  # one build per process; a compiled module is like an import
def native_ops() -> Any | None:
    try:
        from torch.utils.cpp_extension import load

        # torch rebuilds when a source or a flag changes, not a header: the headers'
        # hash rides along as a define
        headers = hashlib.sha256()
        for name in sorted(os.listdir(_CSRC)):
            if name.endswith(".h"):
                with open(os.path.join(_CSRC, name), "rb") as f:
                    headers.update(f.read())
        # -fopenmp: at::parallel_for is inlined from ATen's headers and runs on one thread
        # unless this code itself is built with OpenMP (the symbols resolve to torch's libgomp)
        return load(name="tokenmill_native", sources=[os.path.join(_CSRC, s) for s in _SOURCES],
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp",
                                  f"-DTM_HEADERS={headers.hexdigest()[:16]}"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: run without it
        log.warning("native kernels unavailable, using the torch path: %s", str(exc).splitlines()[0])
        return None
