"""Build and cache the llama.cpp peers for `benchmarks/compare`.

Everything lands under `.peers/` at the repo root (git-ignored):

- `.peers/src/llama_cpp_python-*.tar.gz`  the sdist, the only thing fetched (from PyPI);
- `.peers/llamacpp-venv/`                 a venv with `llama-cpp-python[server]` built from it;
- `.peers/llama-server/bin/llama-server`  built from the sdist's vendored llama.cpp, if it builds,
  with `llama-quantize` (to make Q4_0/Q8_0 files from the same model) and `llama-bench`
  (the engine-level baseline) beside it.

Each step is skipped when its result is already there, so a rerun costs nothing.
A failed llama-server build is reported and remembered (`.peers/llama-server/FAILED`),
not fatal: the comparison goes on without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# A native CPU build (AVX-512/VNNI on these machines); no GPU backends; skip the
# multimodal library, which the benchmark never uses and which doubles the build.
PIP_CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF"

# Nothing may be fetched at build time: no prebuilt web UI, no OpenSSL/BoringSSL, no curl.
SERVER_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
]


@dataclass(frozen=True)
class Peers:
    """Paths to what was built; `llama_server` is None when it could not be built."""

    llamacpp_python: Optional[Path]
    llama_server: Optional[Path]

    def tool(self, name: str) -> Optional[Path]:
        """`llama-quantize` or `llama-bench`, built beside llama-server."""
        if self.llama_server is None:
            return None
        path = self.llama_server.parent / name
        return path if path.exists() else None


def _log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], log: Path, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> None:
    """Run a build step with its output in a log file (builds print thousands of lines)."""
    _log(f"$ {' '.join(cmd)}  (log: {log})")
    with open(log, "ab") as fh:
        subprocess.run(cmd, check=True, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)


# Pinned: a published comparison must name the peer it measured (its vendored llama.cpp
# calls itself 0.5.0-dev; the sdist carries no commit).
LLAMA_CPP_PYTHON = "0.3.36"


def fetch_sdist(cache: Path, base_python: str) -> Path:
    """The llama-cpp-python sdist (LLAMA_CPP_PYTHON) from PyPI, downloaded once."""
    src = cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if (src / name).exists():
        return src / name
    _run([base_python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "-d", str(src), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], cache / "sdist.log")
    found = sorted(src.glob(name))
    if not found:
        raise RuntimeError("pip download produced no llama-cpp-python sdist")
    return found[-1]


def build_llamacpp_python(cache: Path, sdist: Path, base_python: str, jobs: int) -> Path:
    """`.peers/llamacpp-venv` with llama-cpp-python[server]; returns its python."""
    venv = cache / "llamacpp-venv"
    py = venv / "bin" / "python"
    stamp = venv / ".tokenmill-built"
    if stamp.exists():
        _log(f"cached: {venv}")
        return py
    _log("building llama-cpp-python[server] (compiles llama.cpp; ~10-20 min on 2 cores)")
    if not py.exists():
        _run([base_python, "-m", "venv", str(venv)], cache / "llamacpp-venv.log")
    env = dict(os.environ, CMAKE_ARGS=PIP_CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
    _run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], cache / "llamacpp-venv.log", env)
    _run([str(py), "-m", "pip", "install", f"llama-cpp-python[server] @ file://{sdist.resolve()}"],
         cache / "llamacpp-venv.log", env)
    stamp.write_text(sdist.name + "\n")
    return py


TOOLS = ("llama-server", "llama-quantize", "llama-bench")


def build_llama_server(cache: Path, sdist: Path, jobs: int) -> Optional[Path]:
    """`llama-server` (and TOOLS) from the sdist's vendored llama.cpp, or None (and why) if it fails."""
    out = cache / "llama-server"
    binary = out / "bin" / "llama-server"
    failed = out / "FAILED"
    if all((out / "bin" / t).exists() for t in TOOLS):
        _log(f"cached: {binary}")
        return binary
    if failed.exists():
        _log(f"llama-server build failed before ({failed.read_text().strip()}); "
             f"delete {out} to retry; continuing without it")
        return None
    out.mkdir(parents=True, exist_ok=True)
    log = out / "build.log"
    try:
        src = out / "src"
        if not (src / "CMakeLists.txt").exists():
            root = sdist.name.removesuffix(".tar.gz")
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(f"{root}/vendor/llama.cpp/")]
                tar.extractall(out / "extract", members=members, filter="data")
            shutil.move(str(out / "extract" / root / "vendor" / "llama.cpp"), str(src))
            shutil.rmtree(out / "extract", ignore_errors=True)
        build = out / "build"
        _log("building llama-server from vendored llama.cpp (~10 min on 2 cores)")
        _run(["cmake", "-S", str(src), "-B", str(build), *SERVER_CMAKE_ARGS], log)
        _run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(jobs)], log)
        binary.parent.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            shutil.copy2(build / "bin" / tool, binary.parent / tool)
        (out / "VERSION").write_text(sdist.name.removesuffix(".tar.gz") + "\n")
        shutil.rmtree(build, ignore_errors=True)  # ~1 GB of objects; the static binary is enough
        return binary
    except (subprocess.CalledProcessError, OSError, tarfile.TarError) as exc:
        failed.write_text(f"{type(exc).__name__}: {exc}; see {log}\n")
        _log(f"llama-server did not build: {exc}; see {log}; continuing without it")
        return None


def ensure_peers(cache: Path, base_python: str = sys.executable, jobs: int = 2,
                 want_server: bool = True, want_python: bool = True) -> Peers:
    """Build (or reuse) the peers asked for; raises only if llama-cpp-python itself cannot be built."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(cache, base_python)
    py = build_llamacpp_python(cache, sdist, base_python, jobs) if want_python else None
    server = build_llama_server(cache, sdist, jobs) if want_server else None
    return Peers(llamacpp_python=py, llama_server=server)


if __name__ == "__main__":  # build only: `python benchmarks/peers.py [--server-only]`
    root = Path(__file__).resolve().parent.parent
    print(ensure_peers(root / ".peers", want_python="--server-only" not in sys.argv))
