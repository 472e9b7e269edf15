"""Structured logs: every record one JSON object per line (time, level, logger, message, request id)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

# One encoder: `json.dumps` with any non-default argument builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second: tuple[int, str] = (-1, "")  # the last second formatted: one strftime per second

    def _time(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second[0]:
            self._second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
        return f"{self._second[1]}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self._time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if access is not None:  # the access line's fields (registry.ops.middleware)
            entry.update(access)
        else:
            entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _ENCODER.encode(entry)


def log_config(level: str = "info") -> dict[str, Any]:
    """A `logging.config.dictConfig` (also uvicorn's `log_config`) sending every log as JSON to stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": handler},
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "kiln.registry.access": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        },
    }
