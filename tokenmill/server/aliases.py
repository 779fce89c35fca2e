"""Model aliases: a name a request may give for the served model or one pinned snapshot
of it (`--model-alias NAME=TARGET[@YYYY-MM-DD]`). An alias with a date is deprecated:
its answers carry `Deprecation` (RFC 9745) and `Sunset` (RFC 8594) headers naming that
day, so clients learn to move before the operator removes it. An alias to a snapshot id
pins it: once the server runs another snapshot, requests through it are refused (409)."""

from __future__ import annotations

import calendar
import datetime as dt
import re
from dataclasses import dataclass
from email.utils import formatdate

from tokenmill.engine.api import split_snapshot_id

_DATED = re.compile(r"^(?P<target>.+)@(?P<date>\d{4}-\d{2}-\d{2})$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")  # an alias's or a rollout's


@dataclass(frozen=True)
class ModelAlias:
    name: str
    target: str  # the served model's name, or a snapshot id of it
    sunset: dt.date | None = None  # deprecated: the day it goes away

    def headers(self) -> dict[str, str]:
        if self.sunset is None:
            return {}
        ts = calendar.timegm(self.sunset.timetuple())
        return {"Deprecation": f"@{ts}", "Sunset": formatdate(ts, usegmt=True)}

    def as_dict(self) -> dict[str, str | None]:
        return {"id": self.name, "object": "model", "owned_by": "tokenmill", "alias_of": self.target,
                "sunset": self.sunset.isoformat() if self.sunset else None}


def parse_alias(spec: str, served: str) -> ModelAlias:
    """`NAME=TARGET[@YYYY-MM-DD]`, TARGET naming `served` (bare or pinned). Raises
    ValueError naming what is wrong."""
    name, eq, rest = spec.partition("=")
    name, rest = name.strip(), rest.strip()
    if not eq or not name or not rest:
        raise ValueError(f"--model-alias takes NAME=TARGET[@YYYY-MM-DD], got {spec!r}")
    if not NAME.match(name) or "@" in name:
        raise ValueError(f"--model-alias: {name!r} is not a model name (letters, digits, . _ : / -)")
    sunset = None
    m = _DATED.match(rest)
    if m:
        rest = m["target"]
        try:
            sunset = dt.date.fromisoformat(m["date"])
        except ValueError:
            raise ValueError(f"--model-alias: {m['date']!r} is not a date (YYYY-MM-DD)") from None
    base, _ = split_snapshot_id(rest)
    if base != served:
        raise ValueError(f"--model-alias: {name!r} points at {rest!r}, but this server serves {served!r}")
    if name == served:
        raise ValueError(f"--model-alias: {name!r} is the served model's own name")
    return ModelAlias(name, rest, sunset)
