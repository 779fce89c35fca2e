"""Run the app under uvicorn with graceful shutdown.

On the first SIGTERM or SIGINT the server stops admitting (503), gives requests in
flight `shutdown_timeout_s` to finish, aborts the rest, then exits 0. A second
signal exits at once. If the engine dies too often to be restarted, the server exits
with status 3, for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvicorn
from fastapi import FastAPI

from tokenmill.server.app import drain

log = logging.getLogger("tokenmill.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout_s: float):
        super().__init__(config)
        self._fastapi = app
        self._shutdown_timeout_s = shutdown_timeout_s
        self._draining = False
        self.exit_code = 0
        app.state.server.on_fatal = self._fatal

    def _fatal(self) -> None:
        log.critical("the engine cannot be restarted: exiting with status 3")
        self.exit_code = 3
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        if self._draining:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.info("%s received: draining (deadline %.0fs)", signal.Signals(sig).name, self._shutdown_timeout_s)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self._fastapi, self._shutdown_timeout_s)
        finally:
            self.should_exit = True


def run_server(app: FastAPI, host: str, port: int, shutdown_timeout_s: float, log_level: str = "info",
               own_logging: bool = False) -> None:
    """`own_logging`: keep the root logger's handlers (JSON lines) for uvicorn's loggers too."""
    extra = {"log_config": None} if own_logging else {}
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on", **extra)
    server = GracefulServer(config, app, shutdown_timeout_s)
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)
