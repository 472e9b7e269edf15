"""What the registry's response models read from database rows (`core.rows.FromRow`) beside plain columns.

A free-form JSON value read back (`StoredJSON`: a release's lineage and model config, an artifact's
runtime, an audit event's details, a webhook's payload) is answered as stored when it is one the registry
accepts today (`core.untrusted.check_json_value`). One stored by an older registry before those bounds
(nested deeper than 64 levels, an integer past 64 bits, a non-finite number) is answered in its place as
an error in the API's own shape, `{"error": {"code": "STORED_VALUE_UNREADABLE", "message": ..., "details":
{}}}`, so that the row, the listing it is in and every reader of them still answer; the row in the
database is left as it is (nothing stored is lost or rewritten by a read).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ValidatorFunctionWrapHandler, WrapValidator

from kiln.core.untrusted import InvalidJSON, check_json_value
from kiln.registry.api.errors import error_body

UNREADABLE = "STORED_VALUE_UNREADABLE"


def _readable(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(check_json_value(value, what="the stored value"))
    except InvalidJSON as e:
        return error_body(UNREADABLE, f"{e.message}: it was stored before the registry bounded such values")


StoredJSON = Annotated[dict[str, Any], WrapValidator(_readable)]
