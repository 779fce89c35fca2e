"""`tokenmill doctor`: what this machine runs on, and its native kernels built.

Reports torch, the compiler, the CPU features the kernels use, the kernel cache (key and
directory), which paths are active (native kernels, the int8-activation kernels on
AVX-512 VNNI or AVX2) and the embedded model's path; builds the kernels if they are missing (with progress) unless
asked only to report. `make install` runs it so a fresh machine builds up front.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

FEATURES = ("avx512f", "avx512_vnni", "avx512_bf16", "avx2", "fma")


def run_doctor(build: bool = True, echo: Callable[[str], None] = print) -> int:
    """Report (and build what is missing when `build`); 0 when the native kernels are ready,
    1 when they are not (not built, no compiler, or a failed build)."""
    import torch

    from tokenmill.model import kernels

    plan = kernels.plan_build()

    def row(label: str, value: str) -> None:
        echo(f"{label:<19}{value}")

    row("torch", f"{torch.__version__}, {torch.get_num_threads()} threads")
    row("python", platform.python_version())
    row("compiler", plan.compiler_id if plan.compiler else "none found ($CXX or c++): the torch path only")
    row("cpu features", ", ".join(f"{f} {'yes' if f in plan.cpu_features else 'no'}" for f in FEATURES))
    built = plan.built_path is not None
    state = "built" if built else f"last build failed ({plan.failed_log})" if plan.failed_log else "not built"
    row("kernel cache", f"{plan.directory} (key {plan.key}): {state}")

    ops: Any | None = None
    problem = ""
    if built or build:
        try:
            ops = kernels.load_native(plan, verbose=True, retry=True)
        except Exception as exc:  # no compiler, a build error: report it, exit non-zero
            problem = str(exc)
    else:
        problem = f"{state} (tokenmill doctor without --no-build builds them)"
    row("native kernels", "yes" if ops is not None else f"no: {problem}")
    row("vnni int8 kernels", _vnni(ops, plan.cpu_features))
    row("embedded model", _model_path())
    return 0 if ops is not None else 1


def _vnni(ops: Any | None, features: frozenset[str]) -> str:
    if ops is None:
        return "no: no native kernels"
    if ops.quant_gemv_vnni():
        return "yes (AVX-512 VNNI)" if "avx512_vnni" in features else "yes (AVX2)"
    if "avx2" not in features:
        return "no: the CPU has neither AVX-512 VNNI nor AVX2 (int8 layers use torch's kernels)"
    return "no: the kernels were built without AVX-512 VNNI or AVX2"


def _model_path() -> str:
    from tokenmill.model.config import ModelLoadError
    from tokenmill.model.loader import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as exc:
        return f"missing: {exc}"
