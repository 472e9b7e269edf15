"""Response models read from database rows: each field from the row's attribute of the same name
(pydantic's `from_attributes`), nested rows included, and what the row does not hold given by name.

A free-form JSON value read back (`StoredJSON`: a release's lineage and model config, an artifact's
runtime, an audit event's details, a webhook's payload) is answered as stored when it is one the registry
accepts today (`core.untrusted.check_json_value`). One stored by an older registry before those bounds
(nested deeper than 64 levels, an integer past 64 bits, a non-finite number) is answered in its place as
an error in the API's own shape, `{"error": {"code": "STORED_VALUE_UNREADABLE", "message": ..., "details":
{}}}`, so that the row, the listing it is in and every reader of them still answer; the row in the
database is left as it is (nothing stored is lost or rewritten by a read).
"""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, ValidatorFunctionWrapHandler, WrapValidator

from kiln.core.untrusted import InvalidJSON, check_json_value
from kiln.registry.api.errors import error_body

UNREADABLE = "STORED_VALUE_UNREADABLE"


def _readable(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(check_json_value(value, what="the stored value"))
    except InvalidJSON as e:
        return error_body(UNREADABLE, f"{e.message}: it was stored before the registry bounded such values")


StoredJSON = Annotated[dict[str, Any], WrapValidator(_readable)]


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
        return cls.model_validate(_Overlay(row, extra) if extra else row)
