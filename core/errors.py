"""One error hierarchy for all of kiln, each error with a stable code.

Services and stages raise these, each with a code of the catalog (`core.error_codes`): the class's own, or
one named by `code=Codes.NAME`. The catalog gives every code its kind, which fixes the CLI exit status and
the HTTP status the API layer (`registry.api.errors`) answers with. Nothing below the API layer raises HTTP
exceptions.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kiln.core.error_codes import CATALOG, Codes, Kind


class KilnError(Exception):
    """Base of every error kiln reports to a user. `code` is stable and machine-readable."""

    code = Codes.KILN_ERROR
    kind: ClassVar[Kind] = Kind.FAILED

    def __init__(self, message: str, *, code: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.check_code(code)
            self.code = code
        self.details = details or {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.check_code(cls.code)

    @classmethod
    def check_code(cls, code: str) -> None:
        """Refuse a code the catalog does not list, or lists for another kind of error than this class's
        (it would answer another HTTP and exit status than the catalog says)."""
        entry = CATALOG.get(code)
        if entry is None:
            raise ValueError(f"error code {code!r} is not in the catalog (core/error_codes.py)")
        if cls.kind not in entry.kinds:
            kinds = ", ".join(k.name for k in entry.kinds)
            raise ValueError(f"error code {code} is for errors of kind {kinds}, not {cls.__name__} ({cls.kind.name})")

    @classmethod
    def received(cls, message: str, *, code: str, details: dict[str, Any] | None = None) -> KilnError:
        """An error another kiln (a registry, maybe newer) reported: its code is kept even if not listed here."""
        error = cls(message, details=details)
        error.code = code
        return error

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = self.details
        return out


class InvalidInput(KilnError):
    """The caller sent something malformed (HTTP 422, CLI exit 2)."""

    code = Codes.INVALID_INPUT
    kind = Kind.INVALID


class RecipeInvalid(InvalidInput):
    code = Codes.RECIPE_INVALID


class DataFileInvalid(InvalidInput):
    """A file given on the command line is not what it must be: not a regular file, not UTF-8, not YAML or JSON,
    or holding a value JSON cannot (a date, .inf, .nan, a number too long, nesting too deep)."""

    code = Codes.DATA_FILE_INVALID


class ModelCarBaseInvalid(InvalidInput):
    """The model-car base image (or the busybox it is written from) is not one kiln can build on."""

    code = Codes.MODELCAR_BASE_INVALID


class OutputPathInvalid(InvalidInput):
    """A path given for kiln to write is not one it can write a file at (a directory, a FIFO, a device)."""

    code = Codes.OUTPUT_PATH_INVALID


class UnknownName(InvalidInput):
    """A name (target, scheme, hardware) that is not registered; the message lists the known ones."""

    code = Codes.UNKNOWN_NAME


class UnsafeCheckpoint(InvalidInput):
    """A pickle checkpoint or an unsafe path: refused, never loaded."""

    code = Codes.UNSAFE_CHECKPOINT


class SourceInvalid(InvalidInput):
    """The SafeTensors source is malformed (header, offsets, dtypes, shapes vs config)."""

    code = Codes.SOURCE_INVALID


class DigestMismatch(InvalidInput):
    code = Codes.DIGEST_MISMATCH


class NotFound(KilnError):
    code = Codes.NOT_FOUND
    kind = Kind.NOT_FOUND


class Conflict(KilnError):
    """The request contradicts what is stored (HTTP 409); nothing was changed."""

    code = Codes.CONFLICT
    kind = Kind.CONFLICT


class GateFailed(Conflict):
    code = Codes.EVAL_GATE_FAILED
    kind = Kind.GATE_FAILED


class Unauthorized(KilnError):
    code = Codes.UNAUTHORIZED
    kind = Kind.UNAUTHORIZED


class Forbidden(KilnError):
    code = Codes.FORBIDDEN
    kind = Kind.FORBIDDEN


class Unavailable(KilnError):
    """A backend (database, blob store) cannot be reached right now (HTTP 503)."""

    code = Codes.UNAVAILABLE
    kind = Kind.UNAVAILABLE


class StageFailed(KilnError):
    code = Codes.STAGE_FAILED


class Deferred(KilnError):
    """The work needs hardware or software this machine lacks; it is deferred to a runner that has it."""

    code = Codes.DEFERRED


# The class each kind of error is raised as when no narrower one fits.
KIND_CLASSES: dict[Kind, type[KilnError]] = {
    cls.kind: cls
    for cls in (KilnError, InvalidInput, GateFailed, NotFound, Conflict, Unauthorized, Forbidden, Unavailable)
}
