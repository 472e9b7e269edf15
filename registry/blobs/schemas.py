"""API shapes for blobs."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class BlobOut(BaseModel):
    sha256: str
    size: int
    created_at: datetime
