"""The artifact manifest: what a build produced, as the registry stores and serves it."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from kiln.core.digest import sha256_json
from kiln.core.rows import FromRow, StoredOrSentJSON
from kiln.core.untrusted import JSONObject

# A segment may start with '_' (orbax writes _CHECKPOINT_METADATA and _METADATA), never with '.' or '-'.
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+\-]*$")
ARTIFACT_NAME = re.compile(r"^[a-z0-9][a-z0-9._\-]{0,63}$")
# A model's name and a release's version, wherever one is written (recipes) or read (the registry's API).
MODEL_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}$"
# Names a manifest declares: what they are stored in (64 characters) and can be looked up by.
_KIND = r"^[A-Za-z0-9][A-Za-z0-9._+\-]{0,63}$"
HARDWARE_NAME = r"^[a-z0-9][a-z0-9._\-]{0,63}$"
MAX_FILES = 100_000
MAX_PATH_CHARS = 512
# The longest file or directory name ext4, XFS, APFS and NTFS keep: a longer one could not be downloaded
# into a directory as the artifact names it (segments are ASCII, so characters are bytes).
MAX_NAME_CHARS = 255


def check_relative_path(path: str) -> str:
    """Reject absolute paths, traversal, odd characters and over-long names in a file path inside an artifact."""
    if not path or path.startswith("/") or "\\" in path or len(path) > MAX_PATH_CHARS:
        raise ValueError(
            f"invalid file path {path[:100]!r}: must be a relative POSIX path of at most {MAX_PATH_CHARS} characters"
        )
    for seg in path.split("/"):
        if seg in ("", ".", "..") or not _SEGMENT.fullmatch(seg):
            raise ValueError(f"invalid file path {path[:100]!r}: bad segment {seg[:100]!r}")
        if len(seg) > MAX_NAME_CHARS:
            raise ValueError(
                f"invalid file path {path[:100]!r}: the name {seg[:40]!r}… is {len(seg)} characters, "
                f"more than a file system keeps ({MAX_NAME_CHARS})"
            )
    return path


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(strict=True, ge=0, le=2**63 - 1)  # a JSON integer: never "50" or true

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return check_relative_path(v)


class FileOut(BaseModel):
    """A manifest's file as the registry serves it: where to download it (an artifact's detail, a resolve answer)."""

    model_config = ConfigDict(frozen=True)

    path: str
    sha256: str
    size: int
    url: str = Field(description="absolute download URL")


class ArtifactIdentity(FromRow):
    """What an artifact is, wherever kiln names it: its name in the release, the target that made it, its file
    format and quantization, the hardware it runs on and what its runtime needs.

    The one record of these: the build's artifact record, the manifest, a resolve answer, a routing placement and
    a signature's claims embed it, and `ArtifactIdentity.of(x)` reads it from anything that holds its fields (a
    database row, a record that embeds it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="unique within a release, e.g. gguf-q4_k_m")
    target: str = Field(pattern=_KIND, description="registered target name, e.g. gguf, hf-bundle")
    format: str = Field(pattern=_KIND, description="file format, e.g. gguf-v3, safetensors")
    quant: str = Field(pattern=_KIND, description="quantization scheme or GGUF type, e.g. bf16, q4_k_m")
    hardware: list[Annotated[str, StringConstraints(pattern=HARDWARE_NAME)]] = Field(
        max_length=1000, description="hardware profile names this artifact runs on"
    )
    runtime: StoredOrSentJSON = Field(default_factory=dict, description="runtime requirements")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not ARTIFACT_NAME.fullmatch(v):
            raise ValueError(f"invalid artifact name {v!r}: lowercase letters, digits, '.', '_', '-'")
        return v

    def claims(self, *, model: str, version: str) -> dict[str, Any]:
        """What a signature of this artifact in `model@version` claims (`core.signing.ArtifactClaims`), in the
        statement's own words: the name is `artifact`, and the hardware a set (sorted)."""
        return {
            "model": model,
            "version": version,
            "artifact": self.name,
            "target": self.target,
            "format": self.format,
            "quant": self.quant,
            "hardware": sorted(self.hardware),
            "runtime": dict(self.runtime),
        }


class ArtifactManifest(ArtifactIdentity):
    """One artifact: a target's output for one quantization, with where it runs and how it was made."""

    unsupported: dict[
        Annotated[str, StringConstraints(pattern=HARDWARE_NAME)], Annotated[str, StringConstraints(max_length=10_000)]
    ] = Field(
        default_factory=dict,
        max_length=1000,
        description="hardware profile names it does not run on, each with the reason",
    )
    files: list[FileEntry] = Field(max_length=MAX_FILES)
    provenance: JSONObject = Field(default_factory=dict)

    @field_validator("files")
    @classmethod
    def _files(cls, v: list[FileEntry]) -> list[FileEntry]:
        if not v:
            raise ValueError("an artifact needs at least one file")
        paths = [f.path for f in v]
        if len(set(paths)) != len(paths):
            raise ValueError("duplicate file paths in manifest")
        # No directory holds a file and a directory of one name: a copy of the artifact could not exist.
        known = set(paths)
        for path in paths:
            parts = path.split("/")
            for i in range(1, len(parts)):
                if (parent := "/".join(parts[:i])) in known:
                    raise ValueError(f"file path {parent!r} is also a directory of {path!r}")
        return sorted(v, key=lambda f: f.path)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def content_digest(self) -> str:
        """Digest of what a consumer gets (files + declared target/quant/hardware/runtime); not provenance."""
        return sha256_json(self.model_dump(exclude={"provenance"}, mode="json"))
