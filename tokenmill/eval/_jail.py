"""The sandbox launcher: runs one untrusted answer and its tests, then prints one JSON line.

Run as its own process (`python -I -S _jail.py`, the job as JSON on stdin), never
imported: it uses the standard library only, so it starts fast and depends on nothing
the answer could reach. What it does, in order (see tokenmill/eval/sandbox.py for the
caller and docs/evals.md for the guarantees):

1. joins the per-run cgroups the caller made (pids, memory), so every process below is
   counted against them;
2. leaves the host's namespaces: mount, network (an empty one: no interfaces up, so no
   socket reaches anything), pid, IPC, UTS. As root directly; otherwise inside a new
   user namespace where the kernel allows one; else not at all (reported);
3. in the private mount namespace: a size-capped tmpfs as the work folder (gone with
   the namespace), the interpreter's folder bound in read-only (the unprivileged user
   may not be able to reach its real path), every other mount re-mounted read-only and
   nosuid, so a write anywhere outside the work folder fails whatever its permissions;
4. forks the answer's process: pid 1 of the new pid namespace, so when it ends or is
   killed the kernel kills everything it started. It mounts a fresh /proc (host
   processes invisible), sets rlimits (address space, CPU, file size, open files,
   processes where no pids cgroup holds them), drops to the unprivileged uid/gid with
   no groups (as root) or locks the mounts in a nested user namespace (otherwise),
   sets no_new_privs and parent-death SIGKILL, and execs the harness;
5. waits up to the wall limit while keeping a bounded tail of stdout/stderr, then
   SIGKILLs pid 1, and reports. The task passed only if the harness printed the nonce
   that it read (and deleted) before running the answer: an answer that exits early,
   even with status 0, fails.
"""

import ctypes
import json
import os
import re
import resource
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                      "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

# Runs as the unprivileged user. The nonce is read and deleted before the answer runs;
# the answer is a module named "answer" (its `if __name__ == "__main__"` block stays idle),
# the tests run in the answer's namespace after it.
HARNESS = """
import os, sys
with open('.nonce') as f:
    nonce = f.read()
os.unlink('.nonce')
ns = {'__name__': 'answer', '__builtins__': __builtins__}
for name in ('answer.py', 'tests.py'):
    with open(name) as f:
        src = f.read()
    exec(compile(src, name, 'exec'), ns)
sys.stdout.flush()
os.write(1, ('\\n' + nonce + '\\n').encode())
"""

# Inside the mount namespace: a private tmpfs over /tmp with the work folder and the
# interpreter in it. Without a mount namespace the caller's host folders are used.
INNER_TMP, INNER_WORK, INNER_PYTHON = "/tmp", "/tmp/work", "/tmp/python"

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def prctl(option: int, value: int) -> None:
    _check(libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)), "prctl")


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def mounts() -> dict[str, set[str]]:
    """The visible mounts: mount point -> per-mount options, parents first. A point
    mounted over twice lists the top one (the one below cannot be reached)."""
    out: dict[str, set[str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            out.pop(point, None)
            out[point] = set(fields[5].split(","))
    return out


def leave_namespaces(job: dict, report: dict) -> str:
    """Enter new namespaces; returns the mode: "root", "userns" or "none"."""
    base = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if os.geteuid() == 0:
        try:
            unshare(base)
            return "root"
        except OSError as exc:
            report["notes"].append(f"namespaces as root: {exc}")
    uid, gid = os.geteuid(), os.getegid()
    try:
        unshare(base | CLONE_NEWUSER)
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")
        return "userns"
    except OSError as exc:
        report["notes"].append(f"user namespace: {exc}")
        return "none"


def private_filesystem(job: dict, report: dict) -> None:
    """A capped tmpfs over /tmp holding the work folder and the interpreter (bound in
    read-only), every other mount read-only. Inside, the paths are fixed (/tmp/work,
    /tmp/python), so no host folder on the way needs to be reachable by the sandbox uid."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", INNER_TMP, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={job['limits']['disk_mb']}m,nr_inodes=4096,mode=0755")
    os.mkdir(INNER_WORK, 0o700)
    os.mkdir(INNER_PYTHON, 0o755)
    if report["uid"] is not None:
        os.chown(INNER_WORK, job["uid"], job["gid"])
    mount(job["python_prefix"], INNER_PYTHON, None, MS_BIND | MS_REC)
    failed = []
    for point, options in mounts().items():
        if point == INNER_TMP:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for opt in options:
            flags |= MOUNT_OPTION_FLAGS.get(opt, 0)
        try:
            mount(None, point, None, flags)
        except OSError as exc:
            failed.append(f"{point}: {exc.strerror}")
    writable = [p for p, opts in mounts().items() if "rw" in opts and p != INNER_TMP]
    if "/" in writable:
        raise OSError("the root file system could not be made read-only")
    report["filesystem"] = "read-only outside the work folder" if not writable else "partly read-only"
    if writable:
        report["notes"].append(f"still writable: {writable[:8]}; remount errors: {failed[:8]}")


def child(job: dict, mode: str, report: dict, out_w: int, err_w: int) -> None:
    """pid 1 of the new pid namespace: confine itself, then exec the harness. Never returns."""
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if mode != "none":
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        lim = job["limits"]
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if not report["cgroup"].get("pids"):
            resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
        if os.geteuid() == 0 and mode != "userns":
            os.setgroups([])
            os.setgid(job["gid"])
            os.setuid(job["uid"])
        elif mode == "userns":
            # A nested, less privileged user namespace locks every mount as it is now
            # (read-only stays read-only), and the exec below drops all capabilities.
            unshare(CLONE_NEWUSER | CLONE_NEWNS)
            write_file("/proc/self/setgroups", "deny")
            write_file("/proc/self/uid_map", "65534 0 1")
            write_file("/proc/self/gid_map", "65534 0 1")
        work, pyroot = (INNER_WORK, INNER_PYTHON) if mode != "none" else (job["work"], job["python_prefix"])
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.chdir(work)
        os.umask(0o077)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "LD_LIBRARY_PATH": os.path.join(pyroot, "lib")}
        python = os.path.join(pyroot, job["python_exe"])
        os.execve(python, [python, "-I", "-S", "-B", "-c", HARNESS], env)
    except BaseException as exc:  # noqa: BLE001 - anything here is a setup failure
        os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
    os._exit(125)


def collect(pid: int, fds: dict[int, str], job: dict) -> tuple[dict, bool, int]:
    """Read the child's output (a bounded tail of each) until it exits or the wall limit;
    returns the tails, whether it timed out, and its wait status."""
    keep = job["limits"]["output_kb"] * 1024
    bufs = {name: b"" for name in fds.values()}
    deadline = time.monotonic() + job["limits"]["wall_s"]
    timed_out = False
    status = None
    open_fds = dict(fds)
    while open_fds and status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)  # pid 1: the kernel then kills its whole namespace
            break  # (without one, the caller kills the process group and the cgroup)
        ready, _, _ = select.select(list(open_fds), [], [], min(left, 0.2))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                del open_fds[fd]
                continue
            name = open_fds[fd]
            bufs[name] = (bufs[name] + chunk)[-keep:]
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
    for fd, name in open_fds.items():  # what was written before the exit; never wait for more
        os.set_blocking(fd, False)
        try:
            for _ in range(64):  # a writer that outlived the child cannot hold us here
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                bufs[name] = (bufs[name] + chunk)[-keep:]
        except BlockingIOError:
            pass
    if status is None:
        _, status = os.waitpid(pid, 0)
    return bufs, timed_out, status


def main() -> None:
    job = json.load(sys.stdin)
    root = os.geteuid() == 0
    report = {"uid": job["uid"] if root else None, "notes": [], "cgroup": {}, "filesystem": "shared"}
    for kind, path in job["cgroups"].items():
        try:
            write_file(os.path.join(path, "cgroup.procs"), str(os.getpid()))
            report["cgroup"][kind] = True
        except OSError as exc:
            report["notes"].append(f"cgroup {kind}: {exc}")
    mode = leave_namespaces(job, report)
    if mode != "none":
        private_filesystem(job, report)
    report.update(namespaces=mode, network="isolated" if mode != "none" else "shared",
                  pid_namespace=mode != "none")
    work = INNER_WORK if mode != "none" else job["work"]
    nonce = job["nonce"]
    for name, text in (("answer.py", job["answer"]), ("tests.py", job["tests"]), (".nonce", nonce)):
        path = os.path.join(work, name)
        write_file(path, text)
        if root:
            os.chown(path, job["uid"], job["gid"])
    if root and mode == "none":
        os.chown(work, job["uid"], job["gid"])
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        child(job, mode, report, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    bufs, timed_out, status = collect(pid, {out_r: "stdout", err_r: "stderr"}, job)
    wall = time.monotonic() - start
    stdout = bufs["stdout"].decode("utf-8", "replace")
    lines = stdout.rstrip("\n").rsplit("\n", 1)
    passed = (not timed_out and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
              and lines[-1] == nonce)
    if passed:  # the nonce is ours, not the answer's output
        stdout = lines[0] if len(lines) > 1 else ""
    print(json.dumps({
        "passed": passed, "timed_out": timed_out, "wall_s": wall,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "stdout": stdout, "stderr": bufs["stderr"].decode("utf-8", "replace"), "isolation": report,
    }))


if __name__ == "__main__":
    main()
