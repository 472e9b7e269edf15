"""Records read from objects: each field from the object's attribute of the same name (pydantic's
`from_attributes`), nested objects included, and what the object does not hold given by name. The registry's
response models read its database rows so; the artifact's identity (`core.manifest.ArtifactIdentity`) is read
so from a row, a build record or another record that embeds it.

A free-form JSON value read back from a row (`StoredJSON`: a release's lineage and model config, an artifact's
runtime, an audit event's details, a webhook's payload) is answered as stored when it is one the registry
accepts today (`core.untrusted.check_json_value`). One stored by an older registry before those bounds (nested
deeper than 64 levels, an integer past 64 bits, a non-finite number) is answered in its place as an error in
the API's own shape, `{"error": {"code": "STORED_VALUE_UNREADABLE", "message": ..., "details": {}}}`, so that
the row, the listing it is in and every reader of them still answer; the row in the database is left as it
is (nothing stored is lost or rewritten by a read). A field that is checked as sent (`JSONObject`) and read
back from rows too is `StoredOrSentJSON`: lenient when read by `FromRow.of`, checked otherwise.
"""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from kiln.core.error_codes import Codes
from kiln.core.untrusted import InvalidJSON, JSONObject, check_json_value

_READ_FROM_ROW = "kiln.read_from_row"  # the validation context's flag: the value was stored, not sent


def unreadable(message: str) -> dict[str, Any]:
    """What a stored value that kiln now refuses is answered as: an error in the API's shape, in its place."""
    text = f"{message}: it was stored before the registry bounded such values"
    error = {"code": Codes.STORED_VALUE_UNREADABLE, "message": text.encode("utf-8", "backslashreplace").decode()}
    return {"error": {**error, "details": {}}}


def _readable(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(check_json_value(value, what="the stored value"))
    except InvalidJSON as e:
        return unreadable(e.message)


def _stored_or_sent(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    if isinstance(info.context, dict) and info.context.get(_READ_FROM_ROW):
        try:
            check_json_value(value, what="the stored value")
        except InvalidJSON as e:
            return unreadable(e.message)
    return handler(value)


StoredJSON = Annotated[dict[str, Any], WrapValidator(_readable)]
StoredOrSentJSON = Annotated[JSONObject, WrapValidator(_stored_or_sent)]


class _Overlay:
    """`row`, with some attributes given instead (a computed status, a URL, the caller's model name)."""

    __slots__ = ("_extra", "_row")

    def __init__(self, row: object, extra: dict[str, Any]):
        self._row, self._extra = row, extra

    def __getattr__(self, name: str) -> Any:
        extra = object.__getattribute__(self, "_extra")
        if name in extra:
            return extra[name]
        return getattr(object.__getattribute__(self, "_row"), name)


class FromRow(BaseModel):
    """A response model built from a row: `Out.of(row)`, or `Out.of(row, url=...)` for fields the row lacks."""

    model_config = ConfigDict(from_attributes=True)

    @classmethod
    def of(cls, row: object, **extra: Any) -> Self:
        # A model goes through the overlay too: pydantic would hand back one of this class (or a subclass) as it
        # is, where the caller asks for this record's fields alone.
        source = _Overlay(row, extra) if extra or isinstance(row, BaseModel) else row
        return cls.model_validate(source, context={_READ_FROM_ROW: True})
