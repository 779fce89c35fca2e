"""Tracing never slows or fails requests: a collector that accepts connections and never
answers costs the requests nothing, and the server still stops in bounded time."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess

pytestmark = pytest.mark.slow
EXPORT_TIMEOUT_S = 30


class _SilentCollector:
    """Accepts every connection, reads what it is sent, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                self.received += len(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_collector_that_never_answers_costs_requests_nothing():
    collector = _SilentCollector()
    # a long export timeout: a request that waited on an export would take all of it
    srv = ServerProcess("--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}/v1/traces",
                        env={"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(EXPORT_TIMEOUT_S)})
    try:
        srv.wait_ready()
        took = []
        for i in range(12):
            t0 = time.monotonic()
            r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0})
            took.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            time.sleep(0.5)  # let the span processor's batches go out (and hang)
        print(f"12 requests beside a silent collector: {[round(t, 2) for t in took]}s, "
              f"{collector.received} bytes sent to it, {len(collector.conns)} connections")
        assert collector.received > 0, "no span was exported: the test tested nothing"
        assert max(took) < EXPORT_TIMEOUT_S / 2
    finally:
        t0 = time.monotonic()
        srv.stop()
        stopped = time.monotonic() - t0
        collector.close()
    print(f"SIGTERM to exit with a silent collector: {stopped:.1f}s")
    assert srv.proc.returncode == 0
    assert stopped < EXPORT_TIMEOUT_S / 2  # the drain, the engine's stop and at most FLUSH_S for the spans
