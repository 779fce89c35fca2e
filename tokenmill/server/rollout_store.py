"""Rollouts kept across restarts (`serve --data-dir DIR`: DIR/rollouts.db, SQLite).

After every decision (an automatic rollback or promotion, an operator's weights,
promotion or rollback) and every rollout started at run time, its arms, weights, state
and latest decisions are written. At start:

- a `--rollout` whose name is kept with the same two arms takes the kept weights, state
  and decisions: the flag gives only a new rollout's first state, so a canary rolled back
  stays rolled back however often the server restarts with the same flags;
- a kept rollout that was started at run time (POST /v1/rollouts) runs again when both
  its models are still served and its name is free;
- a kept rollout whose flag now names other arms is replaced by the flag's; one whose
  flag is gone does not run (it comes back with its flag).

Outcome windows are not kept: a rollout still running is judged afresh.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from dataclasses import dataclass

from tokenmill.server.rollouts import Rollout, RolloutSpec

log = logging.getLogger("tokenmill.server")
_SCHEMA = """CREATE TABLE IF NOT EXISTS rollouts (
    name TEXT PRIMARY KEY, stable TEXT NOT NULL, canary TEXT NOT NULL, stable_weight INTEGER NOT NULL,
    canary_weight INTEGER NOT NULL, state TEXT NOT NULL, started INTEGER NOT NULL, decisions TEXT NOT NULL)"""


@dataclass(frozen=True)
class Kept:
    spec: RolloutSpec  # its arms, with the weights it had
    state: str
    started: bool  # started at run time (not by a flag)
    decisions: list[dict]


class RolloutStore:
    def __init__(self, data_dir: str):
        os.makedirs(data_dir, exist_ok=True)
        self.path = os.path.join(data_dir, "rollouts.db")
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute(_SCHEMA)

    def load(self) -> dict[str, Kept]:
        rows = self._db.execute("SELECT name, stable, canary, stable_weight, canary_weight, state, started, decisions "
                                "FROM rollouts").fetchall()
        return {r[0]: Kept(RolloutSpec(r[0], r[1], r[2], (r[3], r[4])), r[5], bool(r[6]), json.loads(r[7]))
                for r in rows}

    def save(self, rollout: Rollout, started: bool) -> None:
        """Write one rollout as it is now. A failed write is logged, not raised: the
        decision has been taken in memory and the traffic follows it."""
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO rollouts VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (rollout.name, rollout.stable.model, rollout.canary.model, rollout.stable.weight,
                 rollout.canary.weight, rollout.state, int(started), json.dumps(list(rollout.decisions))))
        except sqlite3.Error as exc:
            log.error("rollout %s: could not keep its state in %s: %s", rollout.name, self.path, exc)

    def close(self) -> None:
        self._db.close()
