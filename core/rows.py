"""Records read from objects: each field from the object's attribute of the same name (pydantic's
`from_attributes`), nested objects included, and what the object does not hold given by name. The registry's
response models read its database rows so; the artifact's identity (`core.manifest.ArtifactIdentity`) is read
so from a row, a build record or another record that embeds it."""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict


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
        return cls.model_validate(_Overlay(row, extra) if extra or isinstance(row, BaseModel) else row)
