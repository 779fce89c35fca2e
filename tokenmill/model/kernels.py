"""Native kernels (tokenmill/model/csrc): paged attention that reads the KV cache through
block tables, the quantized matmuls and the fused ops of a decode step.

They are compiled once per machine with torch's C++ extension builder (1-3 minutes on
two cores; `make install` runs it through `tokenmill doctor`) and cached by what the
binary depends on: the sources' and headers' bytes, the flags, the compiler, torch,
Python and the CPU's features (-march=native). The cache lives in
`<cache root>/<key>/`; checkouts with the same sources share it, and a cache carried to
another CPU gets another key, so it is rebuilt rather than loaded.

A build runs under a lock that holds its owner's pid: others wait for a live owner and
say so; a lock left by a dead one is taken over and the partial build thrown away.

Without a C++ compiler, native_ops() is None and callers use the torch path (one
warning). A failed build with a compiler present is an error in the log and fails
tests/model/test_build.py; it is remembered for its key, so later starts do not spend
minutes failing again: a change of the sources builds anew, `tokenmill doctor` retries.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any

from tokenmill import logs

log = logging.getLogger("tokenmill.model")
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp", "quant_gemv.cpp", "decode_step.cpp",
            "sampling.cpp", "lora.cpp")
# -fopenmp: at::parallel_for is inlined from ATen's headers and runs on one thread unless
# this code itself is built with OpenMP (the symbols resolve to torch's libgomp)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
HEAD_DIMS = (64, 80, 96, 128, 256)  # the head sizes paged_attention is instantiated for
_KEY_FORMAT = 1  # bump when the layout of a cache entry changes
_BUILT = "built"  # in a key's directory: the path of the finished module, relative to it
_FAILED = "failed"  # in a key's directory: the path of the failed build's log, relative to it
_STALE_HELD_S = 10.0  # a lock still held this long after its recorded owner died is taken over

Say = Callable[[str], None]


class BuildError(RuntimeError):
    """The compiler ran and the build failed (the message ends with its output)."""


@dataclass(frozen=True)
class BuildPlan:
    """What this machine would build, and where. `compiler` is None when there is none."""

    key: str
    directory: str  # <cache root>/<key>
    name: str  # the module's name: it carries the key, so no other build can be loaded as it
    files: Mapping[str, bytes]  # csrc's sources and headers, as hashed
    compiler: str | None
    compiler_id: str
    cpu_features: frozenset[str]

    @property
    def built_path(self) -> str | None:
        """The finished module's file, if this key has one."""
        return self._marked(_BUILT)

    @property
    def failed_log(self) -> str | None:
        """The log of this key's last build, if it failed."""
        return self._marked(_FAILED)

    def _marked(self, marker: str) -> str | None:
        try:
            with open(os.path.join(self.directory, marker)) as f:
                path = os.path.join(self.directory, f.read().strip())
        except OSError:
            return None
        return path if os.path.isfile(path) else None


# ---- the key ----

def build_key(files: Mapping[str, bytes], flags: Sequence[str], compiler_id: str, torch_version: str,
              python_version: str, cpu_features: Iterable[str]) -> str:
    """16 hex digits that change when anything the binary depends on changes."""
    facts = {
        "format": _KEY_FORMAT,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
        "flags": list(flags),
        "compiler": compiler_id,
        "torch": torch_version,
        "python": python_version,
        "cpu": sorted(set(cpu_features)),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def cache_root() -> str:
    """$TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill/kernels (~/.cache by default)."""
    root = os.environ.get("TOKENMILL_CACHE_DIR")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "tokenmill", "kernels")


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (what -march=native picks from) and its architecture."""
    arch = f"machine={platform.machine()}"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, arm
                    return frozenset(line.split(":", 1)[1].split()) | {arch}
    except OSError:
        pass
    return frozenset({arch, f"processor={platform.processor()}"})


def find_compiler() -> tuple[str | None, str]:
    """The C++ compiler torch will use ($CXX, else c++) and its identity (path and version),
    or (None, "none") when there is none."""
    command = os.environ.get("CXX", "c++")
    argv = shlex.split(command)
    path = shutil.which(argv[0]) if argv else None
    if path is None:
        return None, "none"
    try:
        out = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None, "none"
    version = out.splitlines()[0] if out.strip() else "unknown version"
    return command, f"{os.path.realpath(path)}: {version}"


def source_files() -> dict[str, bytes]:
    names = list(_SOURCES) + sorted(n for n in os.listdir(_CSRC) if n.endswith(".h"))
    files = {}
    for name in names:
        with open(os.path.join(_CSRC, name), "rb") as f:
            files[name] = f.read()
    return files


@lru_cache(maxsize=1)
def current_key() -> str:
    """plan_build()'s key without importing torch (its version read from the installed
    package's metadata, which is what torch.__version__ reports): a model snapshot
    (tokenmill/model/snapshot.py) names the kernels a front process will run."""
    import importlib.metadata

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    return build_key(source_files(), CFLAGS, find_compiler()[1], torch_version, sys.version, cpu_features())


def plan_build() -> BuildPlan:
    import torch

    files = source_files()
    compiler, compiler_id = find_compiler()
    features = cpu_features()
    key = build_key(files, CFLAGS, compiler_id, torch.__version__, sys.version, features)
    return BuildPlan(key=key, directory=os.path.join(cache_root(), key), name=f"tokenmill_native_{key}",
                     files=files, compiler=compiler, compiler_id=compiler_id, cpu_features=features)


# ---- the lock ----

@dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    boot: str

    def alive(self) -> bool:
        if self.host != socket.gethostname():
            return True  # another machine's process: nothing to check it by
        if self.boot != _boot_id():
            return False  # recorded before a reboot
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _me() -> Owner:
    return Owner(os.getpid(), socket.gethostname(), _boot_id())


def _read_owner(path: str) -> Owner | None:
    try:
        with open(path) as f:
            pid, host, boot = (f.read().split() + ["", "", ""])[:3]
        return Owner(int(pid), host, boot)
    except (OSError, ValueError):
        return None


@contextmanager
def build_lock(path: str, timeout: float | None = None, poll_s: float = 0.2,
               say: Say = logs.say) -> Iterator[Owner | None]:
    """Hold `path` exclusively. Yields the owner who died holding it (its build was
    interrupted) or None.

    The file is flock()ed, so the kernel releases it when its holder dies however it
    dies; it also records the holder's pid, host and boot id, so a waiter can say whom it
    waits for, and a lock still held while its recorded owner is dead (a forked child
    kept the descriptor) is taken over after a few seconds. Raises TimeoutError after
    `timeout` seconds (None: wait as long as a live owner builds)."""
    start = time.monotonic()
    told: Owner | None = None
    dead_since: float | None = None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            owner = _read_owner(path)
            if owner is not None and not owner.alive():
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > _STALE_HELD_S:
                    say(f"taking over the lock {path}: its owner pid {owner.pid} is gone")
                    _unlink(path)  # whoever still holds the old file holds nothing now
                    dead_since = None
                    continue
            else:
                dead_since = None
                if owner is not None and owner != told:
                    say(f"waiting for pid {owner.pid}'s build of the native kernels ({os.path.dirname(path)})")
                    told = owner
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"{path} is still held by pid {owner.pid if owner else '?'}") from None
            time.sleep(poll_s)
            continue
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # taken over and unlinked between our open and our lock: start again
            os.close(fd)
            continue
        break
    try:
        previous = _read_owner(path)
        os.ftruncate(fd, 0)
        me = _me()
        os.pwrite(fd, f"{me.pid} {me.host} {me.boot}\n".encode(), 0)
        yield previous if previous is not None and previous.pid != me.pid else None
    finally:
        os.ftruncate(fd, 0)  # an empty file: released, not interrupted
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- building and loading ----

def _import(name: str, path: str) -> ModuleType:
    import importlib.util

    import torch  # noqa: F401  (the module links against libtorch, loaded by this import)

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_built(plan: BuildPlan) -> ModuleType | None:
    path = plan.built_path
    if path is None:
        return None
    try:
        return _import(plan.name, path)
    except ImportError as exc:  # a damaged cache entry: build it again
        log.warning("cached native kernels in %s do not load (%s); rebuilding", plan.directory, exc)
        return None


def load_native(plan: BuildPlan, verbose: bool = False, retry: bool = False, say: Say = logs.say) -> ModuleType:
    """The compiled module for `plan`: from the cache, or built first (under the lock).
    Raises BuildError if the build fails or, unless `retry`, failed before for this key;
    RuntimeError if there is no compiler."""
    module = _load_built(plan)
    if module is not None:
        return module
    if plan.compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX or c++)")
    _check_failed(plan, retry)
    os.makedirs(plan.directory, exist_ok=True)
    with build_lock(os.path.join(plan.directory, "lock"), say=say) as interrupted:
        module = _load_built(plan)  # the owner we waited for has built it
        if module is not None:
            return module
        _check_failed(plan, retry)  # ... or failed to
        if interrupted is not None:
            say(f"pid {interrupted.pid}'s build was interrupted; building again")
        return _build(plan, verbose, say)


def _check_failed(plan: BuildPlan, retry: bool) -> None:
    log_path = plan.failed_log
    if log_path is not None and not retry:
        raise BuildError(f"the native kernels failed to build for this machine (log: {log_path}); "
                         "after fixing the cause, `tokenmill doctor` builds them again")


def _mark(plan: BuildPlan, marker: str, path: str) -> None:
    tmp = os.path.join(plan.directory, f"{marker}.tmp")
    with open(tmp, "w") as f:
        f.write(os.path.relpath(path, plan.directory) + "\n")
    os.replace(tmp, os.path.join(plan.directory, marker))


def _errors(output: str, most: int = 12) -> str:
    """The compiler's error lines (else the output's tail): the log has the rest."""
    lines = output.splitlines()
    errors = [line for line in lines if "error" in line.lower() or line.startswith("FAILED")]
    return "\n".join((errors or lines)[-most:])


def _build(plan: BuildPlan, verbose: bool, say: Say) -> ModuleType:
    """Build in a fresh build-* directory (we hold the lock). Earlier attempts' directories,
    torch's own lock file in them included, are removed first: under our lock nobody else
    builds, and a compiler orphaned by a killed build writes into a deleted directory."""
    from torch.utils.cpp_extension import load

    _unlink(os.path.join(plan.directory, _BUILT))
    _unlink(os.path.join(plan.directory, _FAILED))
    for entry in os.listdir(plan.directory):
        if entry.startswith("build-"):
            shutil.rmtree(os.path.join(plan.directory, entry), ignore_errors=True)
    attempt = tempfile.mkdtemp(prefix="build-", dir=plan.directory)
    src = os.path.join(attempt, "src")
    os.mkdir(src)
    for name, data in plan.files.items():  # the bytes the key was computed from
        with open(os.path.join(src, name), "wb") as f:
            f.write(data)
    say(f"building native kernels (first use; 1-3 minutes) in {attempt}")
    start = time.monotonic()
    try:
        module = load(name=plan.name, sources=[os.path.join(src, s) for s in _SOURCES],
                      extra_cflags=list(CFLAGS), build_directory=attempt, verbose=verbose)
    except Exception as exc:  # the compiler's errors, a missing ninja: remembered for this key
        log_path = os.path.join(attempt, "build.log")
        with open(log_path, "w") as f:
            f.write(str(exc))
        _mark(plan, _FAILED, log_path)
        say(f"building native kernels failed after {time.monotonic() - start:.0f} s")
        raise BuildError(f"building the native kernels failed (log: {log_path}):\n{_errors(str(exc))}") from exc
    _mark(plan, _BUILT, module.__file__)
    say(f"native kernels built in {time.monotonic() - start:.0f} s")
    return module


def native_ops_for(head_dim: int) -> Any | None:
    """The native module if it is built and supports this model's head size."""
    return native_ops() if head_dim in HEAD_DIMS else None


@lru_cache(maxsize=None)  # one build per process; a compiled module is like an import
def native_ops() -> Any | None:
    """The native module, built on first use if `make install` has not; None (and one
    warning or error in the log) when it cannot be had: callers use the torch path."""
    try:
        plan = plan_build()
        if plan.compiler is None:
            log.warning("no C++ compiler found ($CXX or c++): native kernels are off, using the torch path")
            return None
        return load_native(plan)
    except Exception as exc:  # a build error, no ninja, an unwritable cache: run without it
        log.error("native kernels unavailable, using the torch path: %s", exc)
        return None
