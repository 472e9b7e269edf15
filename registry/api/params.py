"""Names and workload numbers as the API accepts them: one pattern or range each, shared by paths,
queries and bodies."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from kiln.core.hardware import HARDWARE_NAME_PATTERN
from kiln.core.manifest import ARTIFACT_NAME
from kiln.core.manifest import MODEL_NAME_PATTERN as MODEL_NAME_PATTERN  # recipes use the same
from kiln.core.manifest import VERSION_PATTERN as VERSION_PATTERN
from kiln.registry.paging import MAX_PAGE_LIMIT

CHANNEL_PATTERN = r"^[a-z][a-z0-9-]{0,31}$"
ARTIFACT_NAME_PATTERN = ARTIFACT_NAME.pattern
SHA256_PATTERN = r"^[0-9a-f]{64}$"

ModelName = Annotated[str, Path(pattern=MODEL_NAME_PATTERN, description="model name")]
Version = Annotated[str, Path(pattern=VERSION_PATTERN, description="release version")]
ArtifactName = Annotated[str, Path(pattern=ARTIFACT_NAME_PATTERN, description="artifact name")]
ChannelName = Annotated[str, Path(pattern=CHANNEL_PATTERN, description="channel name, e.g. prod")]
# Row ids in paths and cursors: a 32-bit positive integer, as the database stores them (PostgreSQL refuses to
# compare an integer column with a larger one: a server error, not an empty answer).
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="id")]
# How many rows a listing answers at once (registry.paging): the API and the pages alike.
PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT, description="rows per page")]
# Where a listing's page before ended: its last row, by the key the listing is ordered by (a name, a
# version, an id). A page names the next in its `Link` header (the API) or its next link (the pages).
AfterModel = Annotated[str | None, Query(pattern=MODEL_NAME_PATTERN, description="the last model of the page before")]
AfterVersion = Annotated[str | None, Query(pattern=VERSION_PATTERN, description="the last release of the page before")]
AfterArtifact = Annotated[
    str | None, Query(pattern=ARTIFACT_NAME_PATTERN, description="the last artifact of the page before")
]
AfterChannel = Annotated[str | None, Query(pattern=CHANNEL_PATTERN, description="the last channel of the page before")]
AfterHardware = Annotated[
    str | None, Query(pattern=HARDWARE_NAME_PATTERN, description="the last SKU of the page before")
]
AfterKey = Annotated[
    str | None, Query(pattern=SHA256_PATTERN, description="the key_id of the last key of the page before")
]
AfterId = Annotated[int | None, Query(ge=1, le=MAX_ROW_ID, description="the id of the last row of the page before")]
Sha256 = Annotated[str, Path(pattern=SHA256_PATTERN, description="lowercase hex sha256 of the content")]
