"""What the soak samples: each process of the server's group (resident memory, open file
descriptors, threads), the data dir and its SQLite files, the server's /metrics, and the
client's own event-loop lag. Linux /proc only."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from benchmarks.servers import group_processes

MiB = 1024 ** 2
PAGE = os.sysconf("SC_PAGE_SIZE")


def role(pid: int, pgid: int) -> str:
    """server (the group's leader), engine (the spawned step loop), tracker
    (multiprocessing's resource tracker) or other."""
    if pid == pgid:
        return "server"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "other"
    if b"resource_tracker" in cmd:
        return "tracker"
    return "engine" if b"spawn_main" in cmd else "other"


def engine_pid(pgid: int) -> Optional[int]:
    for entry, _ in group_processes(pgid):
        if role(int(entry.name), pgid) == "engine":
            return int(entry.name)
    return None


def processes(pgid: int) -> dict[str, dict[str, float]]:
    """role -> {rss_mib, fds, threads, pids}, summed over that role's live processes."""
    out: dict[str, dict[str, float]] = {}
    for entry, rest in group_processes(pgid):
        try:
            fds = len(os.listdir(entry / "fd"))
        except OSError:
            continue  # gone meanwhile
        r = out.setdefault(role(int(entry.name), pgid), {"rss_mib": 0.0, "fds": 0, "threads": 0, "pids": 0})
        r["rss_mib"] += int(rest[21]) * PAGE / MiB
        r["fds"] += fds
        r["threads"] += int(rest[17])
        r["pids"] += 1
    return out


def disk(paths: list[Path]) -> tuple[float, float]:
    """(MiB of every file under `paths`, MiB of the SQLite files among them, WAL included)."""
    total = sqlite = 0
    for root in paths:
        files = [root] if root.is_file() else (p for p in root.rglob("*") if p.is_file())
        for p in files:
            try:
                size = p.stat().st_size
            except OSError:
                continue
            total += size
            if ".db" in p.name or ".sqlite" in p.name:
                sqlite += size
    return total / MiB, sqlite / MiB


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    """The server's unlabelled Prometheus samples, and per-status HTTP response counts as
    `http_<code>`."""
    out: dict[str, float] = {}
    for line in (await http.get("/metrics", timeout=10)).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        if "{" not in name:
            out[name] = v
        elif name.startswith("tokenmill_http_responses_total{") and 'status_code="' in name:
            out["http_" + name.split('status_code="', 1)[1].split('"', 1)[0]] = v
    return out


class LoopLag:
    """How late the client's event loop wakes a sleeper: the soak's own health (a client
    that lags would make the server look slow)."""

    TICK_S = 0.1

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.TICK_S)
            self.lags.append(max(0.0, time.monotonic() - t - self.TICK_S))

    def take(self) -> dict[str, Optional[float]]:
        lags, self.lags = self.lags, []
        if not lags:
            return {"p99_ms": None, "max_ms": None}
        lags.sort()
        return {"p99_ms": 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))], "max_ms": 1000 * lags[-1]}

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def window_latency(outcomes: list[Any]) -> dict[str, Optional[float]]:
    """p50/p99 TTFT and ITL (ms) of the streamed requests that ended in the window."""
    ttft = [1000 * o.ttft for o in outcomes if o.ttft is not None]
    gaps = [1000 * g for o in outcomes for g in o.gaps]
    return {"ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(gaps, 50),
            "itl_p99_ms": pct(gaps, 99)}
