"""What the cluster tests share."""

from __future__ import annotations

import os


def ray_processes() -> list[str]:
    """Processes of any Ray cluster on this machine (a server must leave none behind)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "raylet" in cmd or "gcs_server" in cmd or cmd.startswith("ray::"):
            out.append(cmd[:120])
    return out
