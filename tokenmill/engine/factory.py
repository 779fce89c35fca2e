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


def make_engine(config: EngineConfig, mode: str = "process", launch_early: bool = True) -> EngineClient:
    """An engine client for `config`: `process` runs the step loop in a child process
    (restarted if it dies), `thread` in a thread of this one. Only metadata is read
    now; weights load when the client starts (a process engine begins loading them at
    once unless `launch_early` is false: a model loaded on demand)."""
    if mode == "process":
        from tokenmill.engine.process_engine import ProcessEngine

        return ProcessEngine(config, launch_early)
    if mode == "thread":
        from tokenmill.engine.async_engine import AsyncEngine

        return AsyncEngine.load(config)
    raise ValueError(f"engine mode must be one of {', '.join(ENGINE_MODES)}, got {mode!r}")


def make_models(configs: list[EngineConfig], *, budget_bytes: int | None = None, keep_alive: float = 300.0,
                max_waiting: int = 64, preload: bool = False) -> EngineClient:
    """One engine client over several models, each its own engine process, loaded on
    first use (or at start with `preload`) within a memory budget (engine/models.py)."""
    from tokenmill.engine.models import ModelRouter

    return ModelRouter(configs, lambda config, early: make_engine(config, "process", early),
                       budget_bytes=budget_bytes, keep_alive=keep_alive, max_waiting=max_waiting, preload=preload)
