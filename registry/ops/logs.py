"""Structured logs: every record one JSON object per line (time, level, logger, message, request id).

Every URL in a record, whichever library logged it (kiln, uvicorn, httpx2, botocore, urllib3), is
written without its user name, password, query and fragment (`RedactUrls`): they carry credentials
(webhook URLs with `?token=`, presigned S3 URLs, `https://user:password@host/`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

# One encoder: `json.dumps` with any non-default argument builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"))
ACCESS_LOGGER = "kiln.registry.access"


# scheme://[userinfo@]host-and-path[?query][#fragment]; userinfo is everything up to the authority's last @.
# A scheme is tried only where a run of scheme characters starts (not at every word boundary inside one,
# which re-scanned the run from each `.`: quadratic in a logged request's text).
_URL = re.compile(
    r"(?P<scheme>(?<![a-z0-9+.-])[a-z][a-z0-9+.-]*://)(?P<userinfo>(?:[^\s/?#@]*@)+)?(?P<rest>[^\s?#\"'<>]*)"
    r"(?P<query>\?[^\s#\"'<>]*)?(?P<fragment>#[^\s\"'<>]*)?",
    re.IGNORECASE,
)
# An HTTP request line's target (`"POST /hook?token=... HTTP/1.1"`, as urllib3 and uvicorn log it).
_REQUEST_LINE = re.compile(
    r"(?P<method>\b(?:GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS|CONNECT|TRACE) +)(?P<rest>/[^\s?#\"'<>]*)"
    r"(?P<query>\?[^\s#\"'<>]*)?(?P<fragment>#[^\s\"'<>]*)?"
)
REDACTED = "REDACTED"
_FORMATTER = logging.Formatter()  # formats exceptions (tracebacks) for redaction, as handlers would


def _redact_match(match: re.Match[str]) -> str:
    start = match["method"] if "method" in match.re.groupindex else match["scheme"]
    url = start + (f"{REDACTED}@" if match.groupdict().get("userinfo") else "") + match["rest"]
    if match["query"]:
        url += f"?{REDACTED}"
    if match["fragment"]:
        url += f"#{REDACTED}"
    return url


def redact_urls(text: str) -> str:
    """`text` with each URL's user name, password, query and fragment replaced by REDACTED, and the
    query and fragment of each HTTP request line's target."""
    if "://" in text:
        text = _URL.sub(_redact_match, text)
    if "?" in text or "#" in text:
        text = _REQUEST_LINE.sub(_redact_match, text)
    return text


class RedactUrls(logging.Filter):
    """A handler filter: the record's message (arguments merged in) and exception with URLs redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: logging reports it when it is formatted
            return True
        redacted = redact_urls(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = _FORMATTER.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_urls(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_urls(record.stack_info)
        return True


class _Clock:
    """ISO-8601 UTC timestamps with milliseconds; one `strftime` per second."""

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")

    def stamp(self, created: float) -> str:
        second = int(created)
        if second != self._second[0]:
            self._second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
        return f"{self._second[1]}.{int((created - second) * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._clock = _Clock()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self._clock.stamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if access is not None:  # the access line's fields (registry.ops.middleware)
            entry.update(access)
        else:
            entry["message"] = record.getMessage()
        if record.exc_text:
            entry["exception"] = record.exc_text
        elif record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return _ENCODER.encode(entry)


def access_fields(entry: Sequence[Any]) -> dict[str, Any]:
    """The access line's fields, in the line's order, from a `registry.ops.middleware.Entry`."""
    _, request_id, method, path, route, status, sent, elapsed, client = entry
    return {
        "request_id": request_id,
        "method": method,
        "path": path,
        "route": route,
        "status": status,
        "bytes": sent,
        "duration_ms": round(elapsed * 1000, 3),
        "client": client,
    }


class AccessLineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The access log's handler under `kiln serve`: JSON lines, written a batch at a time.

    The request middleware's `RequestLog` hands it batches of requests (`write_lines`) without a
    LogRecord: on the hot path logging's record (~20 attributes, thread and process names), its
    dispatch and a write per line cost about as much as answering a cached resolve. Each line is the
    one `JsonFormatter` writes for the same fields, put together directly (strings escaped as the
    encoder escapes them, numbers as it writes them). Other records (`emit`) are written as they come.
    """

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream)
        self.setFormatter(JsonFormatter())
        self._clock = _Clock()

    def write_lines(self, entries: Sequence[Sequence[Any]]) -> None:
        """Write one access line per `registry.ops.middleware.Entry`, in order, and flush."""
        stamp, esc = self._clock.stamp, encode_basestring_ascii
        text = "".join(
            f'{{"time":"{stamp(ended)}","level":"info","logger":"{ACCESS_LOGGER}","request_id":{esc(request_id)},'
            f'"method":{esc(method)},"path":{esc(path)},"route":{esc(route)},"status":{status:d},"bytes":{sent:d},'
            f'"duration_ms":{round(elapsed * 1000, 3)!r},"client":{esc(client)}}}\n'
            for ended, request_id, method, path, route, status, sent, elapsed, client in entries
        )
        with self.lock:  # type: ignore[union-attr]
            try:
                self.stream.write(text)
                self.stream.flush()
            except Exception:  # as logging does: a log that cannot be written never fails a request
                self.handleError(logging.makeLogRecord({"msg": "access log write failed", "name": ACCESS_LOGGER}))


def log_config(level: str = "info") -> dict[str, Any]:
    """A `logging.config.dictConfig` (also uvicorn's `log_config`) sending every log as JSON to stderr,
    URLs redacted (`RedactUrls` on each handler: it sees the records of every logger, libraries' too)."""
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "json",
        "stream": "ext://sys.stderr",
        "filters": ["redact_urls"],
    }
    access = {"class": f"{__name__}.AccessLineHandler", "stream": "ext://sys.stderr", "filters": ["redact_urls"]}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"redact_urls": {"()": RedactUrls}},
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": handler, "access": access},
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            ACCESS_LOGGER: {"handlers": ["access"], "level": "INFO", "propagate": False},
        },
    }
