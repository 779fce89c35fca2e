"""A real server process, started by the tests and driven over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None,
                 new_session: bool = False, command: tuple[str, ...] = ("serve",)):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if "--data-dir" not in args and "--no-batch-api" not in args:  # the Batch API's store: a fresh one
            args = ("--data-dir", tempfile.mkdtemp(prefix="tokenmill-data-"), *args)
        cmd = [sys.executable, "-m", "tokenmill.cli", *command, "--port", str(self.port),
               "--kv-cache-gb", "0.25", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, start_new_session=new_session)

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become ready")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stdout.read() if self.proc.stdout else ""


@pytest.fixture(scope="session")
def server():
    # float32: the exact mode, whose outputs do not depend on batching or cache hits, so
    # tests can compare texts; the default int4 mode is exercised by the other servers.
    srv = ServerProcess("--max-num-seqs", "32", "--dtype", "float32", "--quantization", "none").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def aclient(server):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def add_key(db, tenant, *args) -> str:
    """A tenant's new API key, through the real CLI."""
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "keys", "add", tenant, "--db", str(db), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()
