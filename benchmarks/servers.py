"""Start, wait for and stop the servers that the race (benchmarks/race) and the serving
benchmarks (benchmarks/serving) measure.

Each server is one process (group) that this script starts on its own loopback port,
with its output in a log file; it is stopped by its own process-group id (SIGTERM, then
SIGKILL), never by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

ROOT = Path(__file__).resolve().parent.parent  # the checkout: benchmarks run from here


def serve_cmd(*args: str, cluster: bool = False) -> list[str]:
    """`tokenmill serve` (or `cluster serve`) on the `{port}` a RunningServer fills in, run
    by this interpreter, so the checkout's tokenmill is what is measured."""
    return [sys.executable, "-m", "tokenmill.cli", *(("cluster", "serve") if cluster else ("serve",)),
            "--port", "{port}", *args]


def clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def busy_jiffies() -> int:
    """CPU time spent busy by the whole machine (all cores), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def group_processes(pgid: int):
    """(/proc entry, the fields of its stat after the name) of every live process in
    process group `pgid` (a server and its children)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(rest[2]) == pgid:
            yield entry, rest


def _group_jiffies(pgid: int) -> int:
    """CPU time of every live process in process group `pgid`."""
    return sum(int(rest[11]) + int(rest[12]) for _, rest in group_processes(pgid))  # utime + stime


class CpuWatch:
    """How many cores *other* processes (not the server under test, not this script) kept
    busy during a measurement: this machine is shared, and a neighbour's job on one of
    two cores can slow a spin-waiting thread pool many times over. Linux /proc only."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.t0 = time.monotonic()
        self.start = self._sample()

    def _sample(self) -> tuple[int, int, float]:
        me = os.times()
        return busy_jiffies(), _group_jiffies(self.pgid), (me.user + me.system) * clock_ticks()

    def other_cores(self) -> Optional[float]:
        try:
            end = self._sample()
        except OSError:
            return None
        elapsed = time.monotonic() - self.t0
        other = (end[0] - self.start[0]) - (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, other / clock_ticks() / elapsed) if elapsed > 0 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSpec:
    """How to run one peer: its command (with `{port}` to fill in), the path that answers
    200 once the model is loaded, and request-body extras it needs for a fair workload."""

    name: str
    cmd: list[str]
    ready_path: str
    note: str = ""
    extra_body: Optional[dict[str, Any]] = None
    ignore_eos: bool = True
    env: dict[str, str] = field(default_factory=dict)


class RunningServer:
    """A started server; use as a context manager so it is always stopped."""

    def __init__(self, spec: ServerSpec, log_dir: Path, ready_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{spec.name}.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.load_s: Optional[float] = None

    def __enter__(self) -> "RunningServer":
        cmd = [c.format(port=self.port) for c in self.spec.cmd]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        t0 = time.perf_counter()
        # Own session, so stopping it also stops any children (uvicorn workers, threads).
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, **self.spec.env), cwd=ROOT)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.load_s = time.perf_counter() - t0
        return self

    def watch(self) -> CpuWatch:
        """Start counting other processes' CPU use (call right before measuring)."""
        assert self.proc is not None
        return CpuWatch(self.proc.pid)

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        url = self.base_url + self.spec.ready_path
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} before it was "
                                   f"ready; see {self.log_path}")
            try:
                if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.spec.name} not ready after {self.ready_timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # == its process group id (start_new_session)
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, *exc: object) -> None:
        self.stop()
