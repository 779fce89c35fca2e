"""Per-run cgroups for the sandbox: a process count and a memory total that hold for every
process the answer starts, whoever it runs as.

Made under the cgroup this process is already in (cgroup v1 per controller, or v2 where
the controller is already enabled for children; the host's cgroup settings are never
changed). Where the hierarchy is missing or not writable, no cgroup is made and the
rlimits in the sandbox are the only bounds (the run's isolation report says so).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_paths() -> dict[str, str]:
    """controller (or "" for the v2 unified hierarchy) -> this process's cgroup path."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _parent(controller: str) -> Path | None:
    """The folder to make a child cgroup in for `controller`, if the kernel offers one."""
    own = _own_paths()
    if controller in own and (ROOT / controller).is_dir():  # v1
        return ROOT / controller / own[controller].lstrip("/")
    if "" in own:  # v2: pure (/sys/fs/cgroup) or hybrid (/sys/fs/cgroup/unified)
        for top in (ROOT, ROOT / "unified"):
            here = top / own[""].lstrip("/")
            try:
                if controller in (here / "cgroup.subtree_control").read_text().split():
                    return here
            except OSError:
                continue
    return None


def make(processes: int, memory_bytes: int) -> dict[str, str]:
    """Fresh cgroups with the limits set: {"pids": path, "memory": path}, each only if made."""
    made: dict[str, str] = {}
    name = f"tokenmill-sbx-{uuid.uuid4().hex[:12]}"
    for controller, settings in (("pids", {"pids.max": processes}),
                                 ("memory", {"memory.limit_in_bytes": memory_bytes, "memory.max": memory_bytes,
                                             "memory.swap.max": 0})):
        parent = _parent(controller)
        if parent is None:
            continue
        path = parent / name
        try:
            path.mkdir()
        except OSError:
            continue
        wrote = False
        for file, value in settings.items():
            try:
                (path / file).write_text(str(value))
                wrote = wrote or file != "memory.swap.max"
            except OSError:
                pass
        if wrote:
            made[controller] = str(path)
        else:
            remove(str(path))
    return made


def remove(path: str, timeout_s: float = 10.0) -> bool:
    """Kill whatever is left in the cgroup, then delete it; True when it is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pids = [int(p) for p in Path(path, "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return True
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.05)  # busy until the killed processes are reaped
    return False
