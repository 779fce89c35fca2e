"""The composition root of the engine: builds an `EngineClient` from an `EngineConfig`.

Only the commands that start engines (`tokenmill/cli.py`, the server launch module) and
the cluster's replicas import this module; everything else takes an `EngineClient`
(tokenmill/engine/api.py) it is handed. Importing it pulls in nothing heavy: torch
loads in the engine's thread or process when the client starts.
"""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.engine.api import EngineClient

ENGINE_MODES = ("process", "thread")


def make_engine(config: EngineConfig, mode: str = "process") -> EngineClient:
    """An engine client for `config`: `process` runs the step loop in a child process
    (restarted if it dies), `thread` in a thread of this one. Only metadata is read
    now; weights load when the client starts."""
    if mode == "process":
        from tokenmill.engine.process_engine import ProcessEngine

        return ProcessEngine(config)
    if mode == "thread":
        from tokenmill.engine.async_engine import AsyncEngine

        return AsyncEngine.load(config)
    raise ValueError(f"engine mode must be one of {', '.join(ENGINE_MODES)}, got {mode!r}")
