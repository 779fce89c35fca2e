"""The code sandbox: hostile answers fail their task and leave the machine as it was.

Each hostile case checks the harm it would do did not happen: no process left behind
(of the sandbox uid or in its cgroups), no temporary folder or cgroup left, no file
written outside the work folder, no connection made, the time bounded.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tokenmill.eval import cgroups
from tokenmill.eval.sandbox import NOBODY, Limits, Sandbox

ROOT = os.geteuid() == 0
LIMITS = Limits(wall_s=4, cpu_s=3, memory_mb=256, processes=16)


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "status").read_text().split("\nUid:\t", 1)[1].split()[0] == str(uid):
                    out.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return out


def _sandbox_leftovers(temp_dir: str) -> list[str]:
    found = [str(p) for p in Path(temp_dir).iterdir()]
    for controller in ("pids", "memory"):
        parent = cgroups._parent(controller)
        if parent is not None:
            found += [str(p) for p in parent.glob("tokenmill-sbx-*")]
    return found


@pytest.fixture()
def sandbox(tmp_path):
    temp = tmp_path / "sbx"
    temp.mkdir()
    before = set(_pids_of_uid(NOBODY))
    sb = Sandbox(LIMITS, temp_dir=str(temp))
    yield sb
    if ROOT:
        assert set(_pids_of_uid(NOBODY)) <= before, "a sandboxed process outlived its run"
    assert _sandbox_leftovers(str(temp)) == [], "a sandbox folder or cgroup was left behind"


def test_a_correct_answer_passes_and_runs_confined(sandbox):
    r = sandbox.run("import os\ndef add(a, b):\n    return a + b\nprint(os.getuid(), os.getpid(), os.getcwd())\n",
                    "assert add(2, 3) == 5\n")
    assert r.passed, r
    uid, pid, cwd = r.stdout.split()
    if ROOT:
        assert int(uid) == NOBODY and int(pid) == 1  # unprivileged, pid 1 of its own namespace
        assert r.isolation["network"] == "isolated"
        assert r.isolation["filesystem"] == "read-only outside the work folder"
        assert r.isolation["cgroup"] == {"pids": True, "memory": True}
    assert cwd.endswith("/work")


def test_a_wrong_answer_fails_with_the_assertion(sandbox):
    r = sandbox.run("def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5\n")
    assert not r.passed and "AssertionError" in r.reason


@pytest.mark.parametrize("answer", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n",
                                    "print('ok')\nraise SystemExit\n"])
def test_an_answer_that_exits_before_its_tests_fails(sandbox, answer):
    r = sandbox.run(answer, "assert False, 'the tests ran'\n")
    assert not r.passed and r.reason == "exited before its tests finished"


def test_an_endless_loop_is_stopped_in_time(sandbox):
    t0 = time.monotonic()
    r = sandbox.run("def f():\n    while True:\n        pass\nf()\n", "")
    assert not r.passed
    assert r.timed_out or r.signal is not None  # wall limit or RLIMIT_CPU
    assert time.monotonic() - t0 < LIMITS.wall_s + 5


def test_a_fork_bomb_is_contained_and_leaves_no_process(sandbox):
    bomb = ("import os, time\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        time.sleep(0.01)\n")
    t0 = time.monotonic()
    r = sandbox.run(bomb, "")
    assert not r.passed and r.timed_out
    assert time.monotonic() - t0 < LIMITS.wall_s + 5
    # the fixture checks no process of the sandbox uid and no cgroup is left


def test_a_detached_child_does_not_outlive_the_run(sandbox, tmp_path):
    # setsid + double fork: the classic escape from a process group
    r = sandbox.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                    "        time.sleep(60)\n    os._exit(0)\n", "")
    assert r.passed  # harmless in itself; the fixture checks nothing outlived it


def test_unbounded_allocation_fails_within_the_memory_limit(sandbox):
    answer = ("chunks = []\n"
              "try:\n"
              "    while True:\n"
              "        chunks.append(bytearray(16 << 20))\n"
              "except MemoryError:\n"
              "    print(len(chunks), flush=True)\n"
              "    raise\n")
    r = sandbox.run(answer, "")
    assert not r.passed and "MemoryError" in r.reason
    assert int(r.stdout) * 16 <= LIMITS.memory_mb  # it got no more than its limit


@pytest.mark.skipif(not cgroups._parent("memory"), reason="no memory cgroup to make here")
def test_the_memory_total_holds_across_processes(sandbox):
    # Six processes of 150 MB each stay under the per-process limit (256 MB) but not under
    # the run's total (the memory cgroup): some are killed, so the task fails.
    answer = ("import os\n"
              "def spread(n, mb):\n"
              "    kids = []\n"
              "    for _ in range(n):\n"
              "        pid = os.fork()\n"
              "        if pid == 0:\n"
              "            block = b'x' * (mb << 20)\n"
              "            import time; time.sleep(1)\n"
              "            os._exit(0)\n"
              "        kids.append(pid)\n"
              "    return [os.waitpid(p, 0)[1] for p in kids]\n")
    assert sandbox.run(answer, "assert spread(2, 100) == [0] * 2\n").passed  # within the total
    r = sandbox.run(answer, "assert spread(6, 150) == [0] * 6\n")
    assert not r.passed, r


@pytest.mark.parametrize("parent", ["/var/tmp", "/tmp", "/dev/shm"])
def test_writes_outside_the_work_folder_fail(sandbox, parent):
    # A world-writable folder: only the mount namespace (not the uid) can stop this write.
    if not os.access(parent, os.W_OK):
        pytest.skip(f"{parent} is not writable here")
    target = Path(tempfile.mkdtemp(prefix="tokenmill-probe-", dir=parent))
    try:
        target.chmod(0o777)
        victim = target / "pwned"
        r = sandbox.run(f"open({str(victim)!r}, 'w').write('x')\n", "")
        assert not r.passed
        assert not victim.exists()
        if ROOT and parent != "/tmp":  # (the sandbox's /tmp is its own: the host folder is not there)
            assert "Read-only file system" in r.reason
    finally:
        for p in target.iterdir():
            p.unlink()
        target.rmdir()


def test_the_work_folder_is_private_and_size_capped(sandbox):
    # A file bigger than the file-size limit fails; small files in the work folder work.
    r = sandbox.run("open('small.txt', 'w').write('ok')\nassert open('small.txt').read() == 'ok'\n"
                    "open('big.bin', 'wb').write(b'x' * (64 << 20))\n", "")
    assert not r.passed and ("File too large" in r.reason or "No space" in r.reason or r.signal is not None)


def test_a_socket_reaches_nothing(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        answer = ("import socket\n"
                  "def reach():\n"
                  f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                  "    s.sendall(b'hello')\n"
                  "    return True\n")
        r = sandbox.run(answer, "assert reach()\n")
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert not r.passed
    assert accepted == [], "the sandboxed answer reached a host socket"
    if ROOT:
        assert "Network is unreachable" in r.reason


def test_host_processes_are_invisible(sandbox):
    r = sandbox.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n", "")
    assert r.passed, r
    if ROOT:
        assert r.stdout.strip() == "[1]"


def test_limits_are_checked():
    with pytest.raises(ValueError):
        Limits(wall_s=0)
    with pytest.raises(ValueError):
        Sandbox(uid=0)


UNPRIVILEGED = """
import json, sys
from tokenmill.eval.sandbox import Limits, Sandbox
sb = Sandbox(Limits(wall_s=4, cpu_s=3, memory_mb=256, processes=16))
cases = {
    "ok": "import os\\nprint(os.getpid())\\n",
    "write": "open(sys.argv[1] + '/pwned', 'w').write('x')\\n",
    "remount": "import ctypes\\nlibc = ctypes.CDLL(None, use_errno=True)\\n"
               "assert libc.mount(None, b'/', None, 32 | 4096, None) == 0, 'remount refused'\\n",
    "socket": "import socket\\nsocket.create_connection(('127.0.0.1', int(sys.argv[2])), timeout=2)\\n",
}
out = {}
for name, answer in cases.items():
    r = sb.run("import sys\\nsys.argv = %r\\n" % sys.argv + answer, "")
    out[name] = {"passed": r.passed, "reason": r.reason, "stdout": r.stdout, "isolation": r.isolation}
print(json.dumps(out))
"""


@pytest.mark.skipif(not ROOT or not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/python3.11").exists(),
                    reason="needs root (to become nobody), setpriv and a system python3.11")
def test_an_unprivileged_caller_gets_the_same_confinement_from_a_user_namespace(tmp_path):
    """Run by a non-root user, the sandbox has no uid to drop to: it confines the answer in
    a user namespace (where the kernel allows one) with the same mounts and network."""
    import json
    import subprocess

    target = Path(tempfile.mkdtemp(prefix="tokenmill-probe-", dir="/var/tmp"))
    target.chmod(0o777)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0)
    repo = Path(__file__).resolve().parents[2]
    try:
        proc = subprocess.run(
            ["/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             "/usr/bin/python3.11", "-c", UNPRIVILEGED, str(target), str(listener.getsockname()[1])],
            capture_output=True, text=True, timeout=120, cwd="/", env={"PYTHONPATH": str(repo), "PATH": "/usr/bin"})
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        with pytest.raises(BlockingIOError):
            listener.accept()
        assert not (target / "pwned").exists()
    finally:
        listener.close()
        for p in target.iterdir():
            p.unlink()
        target.rmdir()
    if out["ok"]["isolation"]["namespaces"] != "userns":
        pytest.skip(f"no user namespaces here: {out['ok']['isolation']['notes']}")
    assert out["ok"]["passed"] and out["ok"]["stdout"].strip() == "1"
    assert out["ok"]["isolation"]["filesystem"] == "read-only outside the work folder"
    assert not out["write"]["passed"] and "Read-only file system" in out["write"]["reason"]
    assert not out["remount"]["passed"] and "remount refused" in out["remount"]["reason"]
    assert not out["socket"]["passed"] and "Network is unreachable" in out["socket"]["reason"]
