"""The native build: a cache keyed by what the binary depends on, a lock that cannot hang
on a dead owner, a killed build that the next start finishes, and a failed build that
fails here rather than falling back to torch unnoticed."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tokenmill.model import kernels
from tokenmill.model.kernels import BuildError, build_key, build_lock, native_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _key(**change):
    facts = dict(files={"a.cpp": b"int a;", "b.h": b"#pragma once"}, flags=("-O3", "-march=native"),
                 compiler_id="/usr/bin/g++: g++ 12.2.0", torch_version="2.13.0+cpu",
                 python_version="3.11.7", cpu_features={"avx2", "fma"})
    facts.update(change)
    return build_key(**facts)


def test_key_changes_with_what_the_binary_depends_on():
    base = _key()
    assert _key() == base
    assert _key(files={"b.h": b"#pragma once", "a.cpp": b"int a;"}) == base  # order does not matter
    assert _key(cpu_features=["fma", "avx2", "fma"]) == base
    changed = [
        _key(files={"a.cpp": b"int b;", "b.h": b"#pragma once"}),  # a source byte
        _key(files={"a.cpp": b"int a;", "b.h": b"#pragma once "}),  # a header byte
        _key(files={"a.cpp": b"int a;", "b.h": b"#pragma once", "c.h": b""}),  # a new header
        _key(flags=("-O2", "-march=native")),
        _key(compiler_id="/usr/bin/g++: g++ 13.1.0"),
        _key(torch_version="2.14.0+cpu"),
        _key(python_version="3.11.8"),
        _key(cpu_features={"avx2", "fma", "avx512f"}),  # a cache carried to another CPU
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_key_covers_every_source_and_header_and_not_the_checkout(monkeypatch, tmp_path):
    files = kernels.source_files()
    assert set(kernels._SOURCES) <= set(files)
    assert {n for n in os.listdir(kernels._CSRC) if n.endswith(".h")} <= set(files)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    plan = kernels.plan_build()
    assert plan.directory == os.path.join(str(tmp_path), plan.key)
    assert plan.key in plan.name and ROOT not in plan.directory


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.cache_root() == os.path.join(str(tmp_path), "tokenmill", "kernels")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "mine"))
    assert kernels.cache_root() == str(tmp_path / "mine")


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: the pid names no process
    return child.pid


def _record(pid: int) -> str:
    return f"{pid} {socket.gethostname()} {kernels._boot_id()}\n"


def test_a_lock_left_by_a_dead_owner_is_taken_over_at_once(tmp_path):
    path = tmp_path / "lock"
    pid = _dead_pid()
    path.write_text(_record(pid))
    start = time.monotonic()
    with build_lock(str(path), timeout=5) as interrupted:
        assert interrupted is not None and interrupted.pid == pid
        assert path.read_text().split()[0] == str(os.getpid())
    assert time.monotonic() - start < 1
    assert path.read_text() == ""  # released cleanly: the next holder finds no interrupted build
    with build_lock(str(path), timeout=5) as interrupted:
        assert interrupted is None


_HOLDER = textwrap.dedent("""
    import sys, time
    from tokenmill.model.kernels import build_lock
    with build_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(120)
""")


def test_a_live_owner_is_waited_for_and_its_death_ends_the_wait(tmp_path):
    path = str(tmp_path / "lock")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, path], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        said: list[str] = []
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            with build_lock(path, timeout=1.0, poll_s=0.05, say=said.append):
                pass
        assert time.monotonic() - start >= 1.0
        assert len(said) == 1 and f"pid {holder.pid}" in said[0]  # one line, naming whom it waits for
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        start = time.monotonic()
        with build_lock(path, timeout=5, poll_s=0.05) as interrupted:
            assert interrupted is not None and interrupted.pid == holder.pid
        assert time.monotonic() - start < 1
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_held_in_the_name_of_a_dead_owner_is_taken_over(tmp_path, monkeypatch):
    # a child forked during a build keeps the locked descriptor after its parent died
    monkeypatch.setattr(kernels, "_STALE_HELD_S", 0.2)
    path = str(tmp_path / "lock")
    with open(path, "w") as f:
        f.write(_record(_dead_pid()))
    leftover = os.open(path, os.O_RDWR)
    fcntl.flock(leftover, fcntl.LOCK_EX)
    try:
        said: list[str] = []
        start = time.monotonic()
        with build_lock(path, timeout=5, poll_s=0.05, say=said.append):
            assert open(path).read().split()[0] == str(os.getpid())
        assert time.monotonic() - start < 2
        assert any("taking over" in line for line in said)
    finally:
        os.close(leftover)


def test_a_failed_build_is_remembered_for_its_key(tmp_path):
    # later starts say so at once instead of spending minutes failing again; doctor retries
    plan = dataclasses.replace(kernels.plan_build(), directory=str(tmp_path), compiler="c++")
    (tmp_path / "build-1").mkdir()
    (tmp_path / "build-1" / "build.log").write_text("decode_step.cpp:101: error: 'x' has not been declared\n")
    (tmp_path / "failed").write_text("build-1/build.log\n")
    assert plan.failed_log == str(tmp_path / "build-1" / "build.log")
    start = time.monotonic()
    with pytest.raises(BuildError, match="tokenmill doctor"):
        kernels.load_native(plan)
    assert time.monotonic() - start < 1 and not os.path.exists(tmp_path / "lock")


def _compiler() -> str | None:
    argv = shlex.split(os.environ.get("CXX", "c++"))
    return shutil.which(argv[0]) if argv else None


def test_native_kernels_are_built_where_there_is_a_compiler():
    """Not a skip: with a compiler present, no native module is a failed build."""
    ops = native_ops()
    if _compiler() is None:
        assert ops is None  # the torch path, announced by one warning
        return
    assert ops is not None, "a C++ compiler is present but the native kernels did not build (see the log)"
    plan = kernels.plan_build()
    assert ops.__name__ == plan.name  # the module built for this machine's key
    assert plan.built_path is not None and os.path.dirname(ops.__file__).startswith(plan.directory)


def test_doctor_reports_the_kernels():
    from tokenmill.doctor import run_doctor

    lines: list[str] = []
    code = run_doctor(build=False, echo=lines.append)
    report = "\n".join(lines)
    plan = kernels.plan_build()
    assert plan.key in report and "avx2" in report and "vnni int8 kernels" in report
    assert code == (0 if plan.built_path is not None else 1)


_BUILD = "from tokenmill.model.kernels import native_ops; print('built', native_ops() is not None)"


@pytest.mark.slow
@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler: nothing to build")
def test_a_killed_build_is_finished_by_the_next_start(tmp_path):
    env = dict(os.environ, TOKENMILL_CACHE_DIR=str(tmp_path))
    first = subprocess.Popen([sys.executable, "-c", _BUILD], env=env, cwd=ROOT, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert "building native kernels" in first.stderr.readline()
        time.sleep(5)  # compilers running, torch's lock file taken
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # as a timeout or Ctrl-C would: the build's whole group
        first.wait()
        first.stderr.close()
    (key,) = os.listdir(tmp_path)
    assert open(tmp_path / key / "lock").read().split()[0] == str(first.pid)  # left behind
    assert not os.path.exists(tmp_path / key / "built")

    second = subprocess.run([sys.executable, "-c", _BUILD], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=900)  # one full build; minutes on two busy cores
    assert second.returncode == 0, second.stderr
    assert "interrupted" in second.stderr and "building native kernels" in second.stderr
    assert "native kernels built in" in second.stderr
    assert second.stdout.strip() == "built True", second.stderr
    assert len([e for e in os.listdir(tmp_path / key) if e.startswith("build-")]) == 1  # the partial one is gone
