"""A release's source on a model hub (`source: hf://ORG/REPO@REVISION` in the recipe), used in place.

`huggingface_hub` resolves the revision (a branch, a tag, or kiln's `<channel-or-version>/<artifact>`) to
its commit, and downloads that commit's files kiln reads (config, tokenizer, SafeTensors and their index;
never the pickle checkpoints a repo ships beside them) into its own cache: `HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`. The snapshot is then a source directory like any other:
checked, hashed once at ingest, and linked into the store from the cache, not copied. The commit is what
the build used: the ingest output's provenance records it beside the revision asked for.

The hub is `HF_ENDPOINT` (read when the source is fetched, so a mirror or kiln's own registry, which
speaks the protocol, can stand in for huggingface.co), with `HF_TOKEN` as `huggingface_hub` reads it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, NotFound, Unavailable
from kiln.formats.hf_model import CONFIG_FILES, INDEX_FILE, TOKENIZER_FILES

SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
# What kiln reads of a repo: pickles, GGUF files and images a repo ships beside it are never downloaded.
PATTERNS = (*CONFIG_FILES, *TOKENIZER_FILES, INDEX_FILE, "*.safetensors")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REPO = re.compile(rf"(?:{_PART}/)?{_PART}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+/-]{0,254}")


class HubSourceNotFound(NotFound):
    """The hub has no such repository, or no such revision of it."""

    code = Codes.SOURCE_NOT_FOUND


@dataclass(frozen=True)
class HubSource:
    """`hf://ORG/REPO@REVISION`: a repository of the hub at `HF_ENDPOINT`, at one revision."""

    repo_id: str
    revision: str

    @classmethod
    def parse(cls, url: str) -> HubSource:
        """The source `url` names; INVALID_SOURCE_URL when it is not `hf://ORG/REPO@REVISION`."""
        if not url.startswith(SCHEME):
            raise _invalid(url, f"a hub source starts with {SCHEME}")
        repo, at, revision = url[len(SCHEME) :].partition("@")
        if not _REPO.fullmatch(repo) or ".." in repo:
            raise _invalid(url, "the repository is ORG/REPO (letters, digits, '.', '_', '-')")
        if not at or not revision:
            raise _invalid(
                url, "name the revision the release is built from: hf://ORG/REPO@REVISION (a commit, tag or branch)"
            )
        if not _REVISION.fullmatch(revision) or ".." in revision or revision.endswith("/"):
            raise _invalid(url, f"revision {revision!r} is not a commit, tag or branch name")
        return cls(repo, revision)

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.repo_id}@{self.revision}"

    def fetch(self) -> tuple[Path, dict[str, str]]:
        """The local snapshot of the revision's commit (downloaded into the hub cache unless it is there already),
        and where it came from (`source`, `revision`, `commit`, `endpoint`) for the ingest output's provenance."""
        from huggingface_hub import HfApi, snapshot_download

        endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
        cache_dir = os.environ.get("HF_HUB_CACHE") or None  # else huggingface_hub's own default
        try:
            commit = HfApi(endpoint=endpoint).model_info(self.repo_id, revision=self.revision).sha
            if commit is None or not re.fullmatch(r"[0-9a-f]{40}", commit):
                raise Unavailable(
                    f"{self.url}: {endpoint} named no commit for the revision",
                    code=Codes.SOURCE_UNAVAILABLE,
                    details={"source": self.url, "endpoint": endpoint},
                )
            path = snapshot_download(
                self.repo_id,
                revision=commit,
                cache_dir=cache_dir,
                endpoint=endpoint,
                allow_patterns=list(PATTERNS),
            )
        except Exception as exc:
            raise self._translated(exc, endpoint) from None
        origin = {"source": self.url, "revision": self.revision, "commit": commit, "endpoint": endpoint}
        return Path(str(path)), origin

    def _translated(self, exc: Exception, endpoint: str) -> Exception:
        """`huggingface_hub`'s and httpx's errors as kiln's, with stable codes; anything else unchanged."""
        import httpx
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

        details: dict[str, Any] = {"source": self.url, "endpoint": endpoint}
        if isinstance(exc, RevisionNotFoundError):
            return HubSourceNotFound(
                f"{self.url}: {endpoint} has no revision {self.revision!r} of {self.repo_id}", details=details
            )
        if isinstance(exc, RepositoryNotFoundError):
            return HubSourceNotFound(
                f"{self.url}: {endpoint} has no repository {self.repo_id!r} (or it is private)", details=details
            )
        if isinstance(exc, HfHubHTTPError | httpx.HTTPError | OSError):
            return Unavailable(
                f"{self.url}: {endpoint} cannot be reached or failed ({type(exc).__name__}: {exc})",
                code=Codes.SOURCE_UNAVAILABLE,
                details=details,
            )
        return exc


def _invalid(url: str, why: str) -> InvalidInput:
    return InvalidInput(f"source {url!r}: {why}", code=Codes.INVALID_SOURCE_URL, details={"source": url})


def is_hub_url(source: str) -> bool:
    return source.startswith(SCHEME)
