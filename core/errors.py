"""One error hierarchy for all of kiln, each error with a stable code.

Services and stages raise these; the API layer maps codes to HTTP statuses in one table
(`registry.api.errors`), the CLI maps them to exit codes. Nothing below the API layer
raises HTTP exceptions.
"""

from __future__ import annotations

from typing import Any


class KilnError(Exception):
    """Base of every error kiln reports to a user. `code` is stable and machine-readable."""

    code = "KILN_ERROR"

    def __init__(self, message: str, *, code: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details or {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = self.details
        return out


class InvalidInput(KilnError):
    """The caller sent something malformed (HTTP 422, CLI exit 2)."""

    code = "INVALID_INPUT"


class RecipeInvalid(InvalidInput):
    code = "RECIPE_INVALID"


class DataFileInvalid(InvalidInput):
    """A file given on the command line is not what it must be: not a regular file, not UTF-8, not YAML or JSON,
    or holding a value JSON cannot (a date, .inf, .nan, a number too long, nesting too deep)."""

    code = "DATA_FILE_INVALID"


class OutputPathInvalid(InvalidInput):
    """A path given for kiln to write is not one it can write a file at (a directory, a FIFO, a device)."""

    code = "OUTPUT_PATH_INVALID"


class UnknownName(InvalidInput):
    """A name (target, scheme, hardware) that is not registered; the message lists the known ones."""

    code = "UNKNOWN_NAME"


class UnsafeCheckpoint(InvalidInput):
    """A pickle checkpoint or an unsafe path: refused, never loaded."""

    code = "UNSAFE_CHECKPOINT"


class SourceInvalid(InvalidInput):
    """The SafeTensors source is malformed (header, offsets, dtypes, shapes vs config)."""

    code = "SOURCE_INVALID"


class DigestMismatch(InvalidInput):
    code = "DIGEST_MISMATCH"


class NotFound(KilnError):
    code = "NOT_FOUND"


class Conflict(KilnError):
    """The request contradicts what is stored (HTTP 409); nothing was changed."""

    code = "CONFLICT"


class GateFailed(Conflict):
    code = "EVAL_GATE_FAILED"


class Unauthorized(KilnError):
    code = "UNAUTHORIZED"


class Forbidden(KilnError):
    code = "FORBIDDEN"


class Unavailable(KilnError):
    """A backend (database, blob store) cannot be reached right now (HTTP 503)."""

    code = "UNAVAILABLE"


class StageFailed(KilnError):
    code = "STAGE_FAILED"


class Deferred(KilnError):
    """The work needs hardware or software this machine lacks; it is deferred to a runner that has it."""

    code = "DEFERRED"
