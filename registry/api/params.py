"""Names as the API accepts them: one pattern each, shared by paths, queries and bodies."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path

from core.manifest import ARTIFACT_NAME

MODEL_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}$"
CHANNEL_PATTERN = r"^[a-z][a-z0-9-]{0,31}$"
ARTIFACT_NAME_PATTERN = ARTIFACT_NAME.pattern
SHA256_PATTERN = r"^[0-9a-f]{64}$"

ModelName = Annotated[str, Path(pattern=MODEL_NAME_PATTERN, description="model name")]
Version = Annotated[str, Path(pattern=VERSION_PATTERN, description="release version")]
ArtifactName = Annotated[str, Path(pattern=ARTIFACT_NAME_PATTERN, description="artifact name")]
ChannelName = Annotated[str, Path(pattern=CHANNEL_PATTERN, description="channel name, e.g. prod")]
# Row ids in paths: a 32-bit positive integer, as the database stores them.
RowId = Annotated[int, Path(ge=1, le=2**31 - 1, description="id")]
Sha256 = Annotated[str, Path(pattern=SHA256_PATTERN, description="lowercase hex sha256 of the content")]
