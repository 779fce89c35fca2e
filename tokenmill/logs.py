"""How every tokenmill process writes its lines: text for people, or JSON for machines
(`serve --log-format json`), one object per line. The format is handed to child
processes (the engine) through the environment, so a server in JSON mode writes
nothing else, its preparation notices included."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from typing import Any

_ENV_FORMAT = "TOKENMILL_LOG_FORMAT"
_ENV_LEVEL = "TOKENMILL_LOG_LEVEL"

# set in a request's task, read by the JSON formatter for any line logged under it
current_ids: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "tokenmill_request_ids", default=None)


class JsonFormatter(logging.Formatter):
    """Time, level, logger, message, the request and trace id of the request it was
    logged under (if any), and a record's `fields` (a request line's)."""

    converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
                               "level": record.levelname.lower(), "logger": record.name,
                               "message": record.getMessage()}
        ids = current_ids.get()
        if ids is not None:
            obj["request_id"], obj["trace_id"] = ids
        fields = getattr(record, "fields", None)
        if fields:
            obj.update({k: v for k, v in fields.items() if v is not None})
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, separators=(",", ":"), default=str)


def configure_logging(level: str, fmt: str) -> None:
    """`fmt` is text or json; in json, every request also gets its line (INFO)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    os.environ[_ENV_FORMAT] = fmt  # for the engine's child process
    os.environ[_ENV_LEVEL] = level
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        # a line per request is for machines; in text mode only --log-level debug shows it
        if level.upper() != "DEBUG":
            logging.getLogger("tokenmill.requests").setLevel(logging.WARNING)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def configure_from_env() -> None:
    """In a child process: the format its parent was configured with, if any."""
    fmt = os.environ.get(_ENV_FORMAT)
    if fmt in ("text", "json"):
        configure_logging(os.environ.get(_ENV_LEVEL, "info"), fmt)


def say(msg: str) -> None:
    """One line on stderr, whatever the log level: a long preparation says what it does."""
    if os.environ.get(_ENV_FORMAT) == "json":
        record = logging.LogRecord("tokenmill", logging.INFO, __file__, 0, msg, None, None)
        line = JsonFormatter().format(record)
    else:
        line = f"tokenmill: {msg}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
