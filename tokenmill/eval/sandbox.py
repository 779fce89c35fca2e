"""Run an untrusted code answer against its tests, confined (the caller's side).

`Sandbox(limits).run(answer, tests) -> SandboxResult`. The work is done by a separate
launcher process (tokenmill/eval/_jail.py, standard library only) that confines a child
and reports one JSON line; this side makes the temporary folder and the cgroups, starts
the launcher, and cleans up whatever happens to it. What holds (docs/evals.md):

- time: a wall limit (the launcher SIGKILLs the answer's pid 1, which ends its whole
  pid namespace) and an RLIMIT_CPU;
- memory: RLIMIT_AS per process and, where cgroups allow, a memory total for the run;
- processes: a pids cgroup, else RLIMIT_NPROC (counted per uid);
- files: RLIMIT_FSIZE, a size-capped tmpfs as the work folder, every other mount
  read-only inside the run's mount namespace;
- network: a fresh network namespace with no interface up;
- privilege: as root the answer runs as an unprivileged uid/gid (nobody by default)
  with no groups and no_new_privs; otherwise in a user namespace where the kernel
  allows one. Where neither namespaces nor cgroups can be had the run still happens
  under the rlimits, and `SandboxResult.isolation` says what was missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from tokenmill.eval import cgroups

JAIL = Path(__file__).with_name("_jail.py")
NOBODY = 65534
# The launcher itself (a small Python) sits in the run's cgroups too.
LAUNCHER_MEMORY_MB = 64


@dataclass(frozen=True)
class Limits:
    """Bounds on one run of one answer."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512  # address space of each process
    processes: int = 32  # processes and threads in the run
    file_size_mb: int = 16  # largest file it may write
    disk_mb: int = 32  # its whole work folder
    open_files: int = 64
    output_kb: int = 64  # tail of stdout/stderr kept

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {value}")


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    timed_out: bool = False
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    isolation: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None  # the sandbox itself failed (not the answer)

    @property
    def reason(self) -> str:
        """One line for a report: why the run passed or failed."""
        if self.error:
            return f"sandbox error: {self.error}"
        if self.passed:
            return "tests passed"
        if self.timed_out:
            return "timed out"
        last = next((ln for ln in reversed(self.stderr.strip().splitlines()) if ln.strip()), "")
        if self.signal is not None:
            return f"killed by signal {self.signal}" + (f": {last}" if last else "")
        if self.exit_code == 0:
            return "exited before its tests finished"
        return f"exit {self.exit_code}" + (f": {last[:200]}" if last else "")


def _interpreter() -> tuple[str, str]:
    """(installation prefix, interpreter path relative to it) of the Python running us;
    the answer runs on the same interpreter, bound read-only into its mount namespace."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    rel = os.path.relpath(exe, prefix)
    if rel.startswith(".."):
        raise RuntimeError(f"the interpreter {exe} is not under its prefix {prefix}")
    return prefix, rel


class Sandbox:
    """Runs answers one at a time under `limits`; the unprivileged `uid`/`gid` apply when
    this process is root."""

    def __init__(self, limits: Limits = Limits(), uid: int = NOBODY, gid: int = NOBODY,
                 temp_dir: Optional[str] = None) -> None:
        if uid == 0 or gid == 0:
            raise ValueError("the sandbox uid/gid must not be root")
        self.limits, self.uid, self.gid, self.temp_dir = limits, uid, gid, temp_dir
        self.isolation: Optional[dict[str, Any]] = None  # as the last run reported it

    def describe(self) -> str:
        """How answers were confined (from the last run) and under which limits."""
        lim = self.limits
        bounds = (f"wall {lim.wall_s:g}s, cpu {lim.cpu_s}s, {lim.memory_mb} MiB address space per process, "
                  f"{lim.processes} processes, files {lim.file_size_mb} MiB, folder {lim.disk_mb} MiB")
        iso = self.isolation
        if iso is None:
            return f"not used (no code answer ran); limits: {bounds}"
        groups = ", ".join(k for k, v in iso.get("cgroup", {}).items() if v) or "none"
        who = f"uid {iso['uid']}" if iso.get("uid") is not None else "own uid"
        return (f"{who}, namespaces: {iso.get('namespaces')}, network {iso.get('network')}, "
                f"filesystem {iso.get('filesystem')}, cgroups: {groups}; limits: {bounds}")

    def run(self, answer: str, tests: str) -> SandboxResult:
        """Run `answer` then `tests` (Python source) as one program; passed only if the
        tests ran to their end."""
        prefix, exe = _interpreter()
        top = tempfile.mkdtemp(prefix="tokenmill-sbx-", dir=self.temp_dir)
        groups: dict[str, str] = {}
        try:
            # Used only where no mount namespace can be had (the launcher then works here).
            (Path(top) / "work").mkdir(mode=0o700)
            lim = self.limits
            groups = cgroups.make(lim.processes + 2,
                                  (lim.memory_mb + lim.disk_mb + LAUNCHER_MEMORY_MB) << 20)
            job = {"work": os.path.join(top, "work"), "python_prefix": prefix, "python_exe": exe,
                   "uid": self.uid, "gid": self.gid,
                   "limits": asdict(lim), "cgroups": groups, "nonce": secrets.token_hex(16),
                   "answer": answer, "tests": tests}
            return self._launch(job)
        finally:
            for path in groups.values():
                cgroups.remove(path)
            shutil.rmtree(top, ignore_errors=True)

    def _launch(self, job: dict[str, Any]) -> SandboxResult:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", str(JAIL)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        try:
            out, err = proc.communicate(json.dumps(job).encode(), timeout=self.limits.wall_s + 20)
        except subprocess.TimeoutExpired:
            out, err = b"", b"the launcher did not finish"
        finally:
            try:  # whatever is left of its session (only outside a pid namespace can there be any)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        try:
            data = json.loads(out.decode().strip().splitlines()[-1])
        except (IndexError, ValueError):
            tail = err.decode("utf-8", "replace").strip()[-500:]
            return SandboxResult(passed=False, error=f"launcher exit {proc.returncode}: {tail}")
        result = SandboxResult(**data)
        self.isolation = result.isolation
        return result
