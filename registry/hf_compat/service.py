"""What the Hub protocol's names mean in the registry: repos, revisions, commits and tree entries.

- repo id: a model name, optionally under the namespace `kiln` (`tiny-llama` or `kiln/tiny-llama`).
- revision: `<channel-or-version>/<artifact>` (`prod/gguf-q4_k_m`, `1.0.0/hf-bundle-bf16`; a
  channel wins over a version of the same name) or a commit id.
- commit id: the first 40 hex digits of the artifact's manifest digest. It names the artifact's
  content (files, target, quant, hardware, runtime), so it never changes once published, and the
  client's cache is keyed by it.
- files are served as LFS entries: `lfs.oid` is the file's sha256 (the client's ETag), `oid` the git
  blob id of the LFS pointer file that would stand for it in a git repository.

Errors carry the Hub's `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`) so the
client raises its own exceptions (`file_exists` returns False for a missing file).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from sqlalchemy.orm import Session

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, NotFound
from kiln.registry.api.params import MODEL_NAME_PATTERN
from kiln.registry.artifacts.service import WITH_FILES, Artifact, ArtifactFile, find_artifact
from kiln.registry.channels.service import find_channel
from kiln.registry.models.service import find_model
from kiln.registry.releases.contents import served_artifacts
from kiln.registry.releases.service import find_release

NAMESPACE = "kiln"
COMMIT = re.compile(r"[0-9a-f]{40}")
_REF = r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}"
_REVISION = re.compile(rf"(?P<ref>{_REF})/(?P<artifact>[a-z0-9][a-z0-9._-]{{0,63}})")
_MODEL = re.compile(MODEL_NAME_PATTERN.removeprefix("^").removesuffix("$"))


class HubError(NotFound):
    """A Hub-protocol miss, with the `X-Error-Code` the Hub client understands."""

    def __init__(self, message: str, hub_code: str, code: str, details: dict[str, object]) -> None:
        super().__init__(message, code=code, details={**details, "hub_error_code": hub_code})
        self.hub_code = hub_code


class InvalidRevision(InvalidInput):
    code = Codes.INVALID_REVISION


@dataclass(frozen=True)
class Resolved:
    """A revision resolved to one artifact of one release."""

    repo_id: str
    model: str
    version: str
    artifact: Artifact  # with files loaded

    @property
    def commit(self) -> str:
        return commit_id(self.artifact)


def commit_id(artifact: Artifact) -> str:
    return artifact.manifest_digest[:40]


def model_name(repo_id: str) -> str:
    """The model a repo id names; anything else is RepoNotFound."""
    namespace, _, name = repo_id.rpartition("/")
    if namespace not in ("", NAMESPACE) or not _MODEL.fullmatch(name):
        raise HubError(
            f"repository {repo_id!r} not found: repo ids are '<model>' or '{NAMESPACE}/<model>'",
            "RepoNotFound",
            Codes.REPO_NOT_FOUND,
            {"repo_id": repo_id},
        )
    return name


def resolve_revision(session: Session, repo_id: str, revision: str) -> Resolved:
    """The artifact `revision` names in the model `repo_id` names (files loaded)."""
    model = model_name(repo_id)
    model_row = find_model(session, model)
    if model_row is None:
        raise HubError(f"repository {repo_id!r} not found", "RepoNotFound", Codes.REPO_NOT_FOUND, {"repo_id": repo_id})
    if COMMIT.fullmatch(revision):
        # Only a served release's artifacts: a yanked or unsealed one is not served by any name.
        found = served_artifacts(session, model_row.id, *WITH_FILES, digest_prefix=revision)
        if not found:
            raise _revision_not_found(repo_id, revision, f"no served artifact of {model!r} has commit {revision}")
        return Resolved(repo_id, model, *found[0])
    match = _REVISION.fullmatch(revision)
    if match is None:
        raise InvalidRevision(
            f"revision {revision!r} is not '<channel-or-version>/<artifact>' (e.g. 'prod/gguf-q4_k_m') "
            "or a 40-hex commit id",
            details={"revision": revision},
        )
    ref, name = match["ref"], match["artifact"]
    channel = find_channel(session, model_row.id, ref)
    version = channel.release.version if channel is not None else ref
    release = find_release(session, model, version)
    if release is None:
        raise _revision_not_found(repo_id, revision, f"{model!r} has no channel or version {ref!r}")
    artifact = find_artifact(session, release.id, name)
    if artifact is None:
        raise _revision_not_found(repo_id, revision, f"release {model}@{version} has no artifact {name!r}")
    if release.yanked_at is not None:
        raise _revision_not_found(repo_id, revision, f"release {model}@{version} is yanked")
    if release.status != "sealed":
        raise _revision_not_found(repo_id, revision, f"release {model}@{version} is {release.status}")
    return Resolved(repo_id, model, version, artifact)


def _revision_not_found(repo_id: str, revision: str, why: str) -> HubError:
    return HubError(
        f"revision {revision!r} not found in {repo_id!r}: {why}",
        "RevisionNotFound",
        Codes.REVISION_NOT_FOUND,
        {"repo_id": repo_id, "revision": revision},
    )


def find_file(resolved: Resolved, path: str) -> ArtifactFile:
    for f in resolved.artifact.files:
        if f.path == path:
            return f
    raise HubError(
        f"{path!r} is not a file of {resolved.model}@{resolved.version} artifact {resolved.artifact.name!r}",
        "EntryNotFound",
        Codes.ENTRY_NOT_FOUND,
        {"repo_id": resolved.repo_id, "path": path},
    )


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git LFS pointer file that stands for a blob in a git repository."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def tree_page(entries: list[dict[str, object]], cursor: str | None, limit: int) -> tuple[list[dict[str, object]], bool]:
    """Up to `limit` of a tree's `entries` after the one whose path is `cursor` (PAGE_CURSOR_UNKNOWN when no entry
    has it), and whether more follow."""
    start = 0
    if cursor is not None:
        paths = [e["path"] for e in entries]
        if cursor not in paths:
            raise InvalidInput(
                f"no entry {cursor[:200]!r} in this tree to list entries after",
                code=Codes.PAGE_CURSOR_UNKNOWN,
                details={"cursor": cursor[:200]},
            )
        start = paths.index(cursor) + 1
    return entries[start : start + limit], len(entries) > start + limit


def tree_entries(resolved: Resolved, prefix: str = "", recursive: bool = False) -> list[dict[str, object]]:
    """The Hub's tree listing of the artifact's files under `prefix` (folders first, as the Hub lists them)."""
    prefix = prefix.strip("/")
    base = f"{prefix}/" if prefix else ""
    files: list[dict[str, object]] = []
    folders: dict[str, None] = {}
    for f in resolved.artifact.files:
        if not f.path.startswith(base):
            continue
        rest = f.path[len(base) :]
        parts = rest.split("/")
        for depth in range(1, len(parts)):
            if recursive or depth == 1:
                folders.setdefault(base + "/".join(parts[:depth]), None)
        if recursive or len(parts) == 1:
            pointer = lfs_pointer(f.sha256, f.size)
            files.append(
                {
                    "type": "file",
                    "path": f.path,
                    "size": f.size,
                    "oid": git_blob_id(pointer),
                    "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": len(pointer)},
                }
            )
    if prefix and not files and not folders:
        raise HubError(
            f"{prefix!r} is not a folder of artifact {resolved.artifact.name!r}",
            "EntryNotFound",
            Codes.ENTRY_NOT_FOUND,
            {"repo_id": resolved.repo_id, "path": prefix},
        )
    dirs: list[dict[str, object]] = [
        {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode(), usedforsecurity=False).hexdigest()}
        for d in sorted(folders)
    ]
    return dirs + sorted(files, key=lambda e: str(e["path"]))
