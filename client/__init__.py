"""`RegistryClient`: the one way kiln's CLI (publish, promote, resolve) talks to a registry.

`RegistryClient.connect("http://registry:8000")` talks to a server over HTTP;
`RegistryClient.connect(".kiln/registry")` builds the embedded registry for that directory and
talks to it in process through the same HTTP API (Starlette's TestClient, a synchronous
httpx2.Client over ASGI), so both cases run the same code. (httpx2 is the maintained successor
of httpx, same API; Starlette's TestClient is built on it, so both paths use it.) Server errors
come back as the matching `core.errors` class, carrying the server's code, message and details.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote, urljoin

import httpx2
from pydantic import BaseModel, TypeAdapter

from kiln.core import errors
from kiln.core.access import AttestationKind, AttestationOut, AuditEventOut, TokenCreated, TokenOut, TrustedKeyOut
from kiln.core.channels import ChannelDetail
from kiln.core.digest import CHUNK
from kiln.core.error_codes import CATALOG, Codes
from kiln.core.errors import DigestMismatch, KilnError, Unavailable
from kiln.core.evals import PublishedEval, RecordedEval
from kiln.core.hardware import HardwareOut, HardwareProfile
from kiln.core.manifest import ArtifactManifest, check_relative_path
from kiln.core.performance import PerformanceCreate, PerformanceOut
from kiln.core.releases import ArtifactDetail, ModelOut, ReleaseDetail, ReleaseOut
from kiln.core.resolve import ResolveOut
from kiln.core.signing import ATTESTATION_FILES
from kiln.registry.paging import MAX_PAGE_LIMIT

_ERRORS_BY_STATUS: dict[int, type[KilnError]] = {
    400: errors.InvalidInput,
    401: errors.Unauthorized,
    403: errors.Forbidden,
    404: errors.NotFound,
    409: errors.Conflict,
    413: errors.InvalidInput,
    416: errors.InvalidInput,
    422: errors.InvalidInput,
    503: errors.Unavailable,
}


def _kiln_error_classes() -> dict[str, type[KilnError]]:
    found: dict[str, type[KilnError]] = {}
    pending: list[type[KilnError]] = [KilnError]
    while pending:
        cls = pending.pop()
        if cls.__module__ == errors.__name__:
            found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


def _error_class(code: str, status: int) -> type[KilnError]:
    """The class of a registry's error: the core class of its code, else the kind the catalog gives the code
    (the one answered with this status, for a code of two kinds), else one by the HTTP status."""
    exact = _kiln_error_classes().get(code)
    if exact is not None:
        return exact
    entry = CATALOG.get(code)
    if entry is None:
        return _ERRORS_BY_STATUS.get(status, KilnError)
    kind = next((k for k in entry.kinds if entry.http_status(k) == status), entry.kinds[0])
    return errors.KIND_CLASSES[kind]


def error_from_response(response: httpx2.Response) -> KilnError:
    """The kiln error a registry error response stands for: by its code, else by HTTP status."""
    try:
        data = response.json()
        if isinstance(data, dict) and "errors" in data:  # the OCI distribution API's shape, under /v2/
            first = data["errors"][0]
            code, message, details = str(first["code"]), str(first["message"]), {"detail": first.get("detail")}
        else:
            body = data["error"]
            code, message, details = str(body["code"]), str(body["message"]), dict(body.get("details") or {})
    except (ValueError, KeyError, TypeError, IndexError):
        code, message, details = f"HTTP_{response.status_code}", response.text[:500] or response.reason_phrase, {}
    cls = _error_class(code, response.status_code)
    # A newer registry may answer a code this client's catalog does not list: kept as it was sent.
    return cls.received(message, code=code, details={**details, "http_status": response.status_code})


@dataclass(frozen=True)
class BlobUpload:
    sha256: str
    size: int
    uploaded: bool  # False: the registry already had it


def _file_chunks(path: Path, chunk: int = CHUNK) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while data := f.read(chunk):
            yield data


def _sha256_and_size(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    for data in _file_chunks(path):
        digest.update(data)
        size += len(data)
    return digest.hexdigest(), size


class _StreamedBodyTransport(httpx2.BaseTransport):
    """Lets the in-process client stream request bodies.

    Starlette's TestClient transport reads a request body whole (`request.read()`) unless that
    returns a generator, which it then feeds to the app chunk by chunk. Streamed bodies (blob
    uploads) are presented that way, so an embedded upload never holds the file in memory.
    """

    def __init__(self, inner: httpx2.BaseTransport):
        self._inner = inner

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if not isinstance(request.stream, httpx2.ByteStream):
            body = (bytes(chunk) for chunk in request.stream)  # type: ignore[union-attr]
            request.read = lambda: body  # type: ignore[method-assign,assignment,return-value]
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def _seg(value: str) -> str:
    return quote(value, safe="")


def _next_page(response: httpx2.Response) -> str | None:
    """The URL of the next page a listing's answer names in its `Link` header (relative to the answer's), or None."""
    url = response.links.get("next", {}).get("url")
    return urljoin(str(response.url), url) if url else None


EMBEDDED_PUBLIC_URL = "http://127.0.0.1:8000"

Answer = TypeVar("Answer", bound=BaseModel)
Query = Mapping[str, str | int | float]  # a request's query parameters


class RegistryClient:
    """A registry over HTTP. Methods return the server's answers as the records of `core` (`core.releases`,
    `core.channels`, `core.access`, ...); errors raise `core.errors`."""

    def __init__(self, http: httpx2.Client, location: str, on_close: Callable[[], object] | None = None):
        self._http = http
        self.location = location
        self._on_close = on_close or http.close

    @classmethod
    def connect(
        cls, url_or_dir: str | Path, *, headers: dict[str, str] | None = None, token: str | None = None
    ) -> RegistryClient:
        """A client for `http(s)://...` (a server), a database URL, or a directory (the embedded registry).

        A server gets `token` (default: $KILN_TOKEN) as `Authorization: Bearer`. A directory or a
        database URL (`postgresql://...`, `sqlite:///...`) is opened in process with access control
        off: whoever can open the database is its administrator (how the first admin token is made).
        """
        target = str(url_or_dir)
        if target.startswith(("http://", "https://")):
            timeout = httpx2.Timeout(300.0, connect=10.0)
            token = token or os.environ.get("KILN_TOKEN")
            headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
            return cls(httpx2.Client(base_url=target.rstrip("/"), headers=headers, timeout=timeout), target)
        # Imported here: talking to a server needs none of the server's code.
        from starlette.testclient import TestClient

        from kiln.registry.app import create_app
        from kiln.registry.settings import RegistrySettings

        # Download URLs name the server `kiln serve --data-dir DIR` runs by default over the same directory.
        if target.startswith(("postgresql", "sqlite:")):
            settings = RegistrySettings(database_url=target, auth_required=False)
        else:
            settings = RegistrySettings(data_dir=Path(target), auth_required=False)
        if settings.public_url is None:
            settings = settings.model_copy(update={"public_url": EMBEDDED_PUBLIC_URL})
        app = create_app(settings)
        client = TestClient(app, base_url=EMBEDDED_PUBLIC_URL, headers=headers)
        client._transport = _StreamedBodyTransport(client._transport)
        client.__enter__()  # one event loop and app lifespan for the client's lifetime
        return cls(client, str(Path(target).resolve()), on_close=lambda: client.__exit__(None, None, None))

    def close(self) -> None:
        """Close the connection (embedded: shut the in-process app down and release its database)."""
        self._on_close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RegistryClient({self.location!r})"

    # -- plumbing ------------------------------------------------------------------------------

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx2.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx2.TransportError as exc:
            raise Unavailable(f"registry {self.location} unreachable: {exc}") from exc
        if response.status_code >= 400:
            raise error_from_response(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._send(method, path, **kwargs).json()

    def _answer(self, record: type[Answer], method: str, path: str, **kwargs: Any) -> Answer:
        """The registry's answer to a request, read into `record` (past what a newer registry adds)."""
        return record.model_validate(self._json(method, path, **kwargs))

    def _pages(self, path: str, params: Query | None = None) -> Iterator[httpx2.Response]:
        """Every page of a listing: `path`, then each page the one before names in its `Link: <url>; rel="next"`
        (the URL holds the query, `params` included)."""
        response = self._send("GET", path, params=params)
        yield response
        while (url := _next_page(response)) is not None:
            response = self._send("GET", url)
            yield response

    def _list(
        self, record: type[Answer], path: str, params: Query | None = None, most: int | None = None
    ) -> list[Answer]:
        """The rows of a listing, page after page, each read into `record`: all of them, or the first `most`."""
        rows: list[Answer] = []
        page = _rows_of(record)
        for response in self._pages(path, params):
            rows.extend(page.validate_python(response.json()))
            if most is not None and len(rows) >= most:
                return rows[:most]
        return rows

    # -- models and releases --------------------------------------------------------------------

    def ensure_model(self, name: str, description: str | None = None) -> ModelOut:
        """Create the model if needed. With `description` None an existing model is accepted as is."""
        body = {"name": name}
        if description is not None:
            body["description"] = description
        return self._answer(ModelOut, "POST", "/v1/models", json=body)

    def create_release(
        self,
        model: str,
        version: str,
        source_digest: str,
        planned_artifacts: list[str],
        lineage: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
    ) -> ReleaseOut:
        """Open `model@version`, to hold `planned_artifacts` (idempotent for identical content; Conflict
        if it differs). It is served only once `seal_release` finds every planned artifact evaluated.

        `lineage` and `model_config` are open JSON objects (where the source came from; the model's config,
        as `core.shape.ShapeRecord` or a Hugging Face config.json), stored as sent."""
        body = {
            "version": version,
            "source_digest": source_digest,
            "planned_artifacts": planned_artifacts,
            "lineage": lineage or {},
            "model_config": model_config or {},
        }
        return self._answer(ReleaseOut, "POST", f"/v1/models/{_seg(model)}/releases", json=body)

    def seal_release(self, model: str, version: str) -> ReleaseOut:
        """Seal `model@version` (idempotent); RELEASE_INCOMPLETE (Conflict) names what is still missing."""
        return self._answer(ReleaseOut, "POST", f"/v1/models/{_seg(model)}/releases/{_seg(version)}/seal")

    def abandon_release(self, model: str, version: str, reason: str) -> ReleaseOut:
        """Abandon an open release: never sealed; its artifacts are dropped and their blobs collectable."""
        path = f"/v1/models/{_seg(model)}/releases/{_seg(version)}/abandon"
        return self._answer(ReleaseOut, "POST", path, json={"reason": reason})

    def list_models(self) -> list[ModelOut]:
        """The models the caller may read, by name."""
        return self._list(ModelOut, "/v1/models")

    def list_releases(self, model: str) -> list[ReleaseOut]:
        """A model's releases, newest first, with their status (open, sealed, abandoned)."""
        return self._list(ReleaseOut, f"/v1/models/{_seg(model)}/releases")

    def get_release(self, model: str, version: str) -> ReleaseDetail:
        """The release with its artifacts, their eval results and gate status."""
        return self._answer(ReleaseDetail, "GET", f"/v1/models/{_seg(model)}/releases/{_seg(version)}")

    # -- blobs and artifacts --------------------------------------------------------------------

    def blob_exists(self, sha256: str) -> bool:
        try:
            self._send("HEAD", f"/v1/blobs/{sha256}")
        except errors.NotFound:
            return False
        return True

    def upload_blob(self, path: str | Path, sha256: str | None = None) -> BlobUpload:
        """Upload a file as a blob unless the registry has it; streamed, never read whole.

        `sha256` (if known, e.g. from a manifest) is checked against the file before uploading.
        """
        path = Path(path)
        actual, size = _sha256_and_size(path)
        if sha256 is not None and sha256 != actual:
            raise DigestMismatch(
                f"{path} has sha256 {actual}, not {sha256}", details={"path": str(path), "expected": sha256}
            )
        if self.blob_exists(actual):
            return BlobUpload(actual, size, uploaded=False)
        self._send(
            "PUT",
            f"/v1/blobs/{actual}",
            content=_file_chunks(path),
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
        )
        return BlobUpload(actual, size, uploaded=True)

    def publish_artifact(
        self,
        model: str,
        version: str,
        manifest: ArtifactManifest,
        files_root: str | Path | None = None,
    ) -> ArtifactDetail:
        """Publish an artifact manifest. With `files_root`, first upload each file from `files_root/path`."""
        path = f"/v1/models/{_seg(model)}/releases/{_seg(version)}/artifacts"
        for attempt in (1, 2):
            if files_root is not None:
                for entry in manifest.files:
                    self.upload_blob(Path(files_root) / entry.path, sha256=entry.sha256)
            try:
                return self._answer(ArtifactDetail, "POST", path, json=manifest.model_dump(mode="json"))
            except errors.InvalidInput as exc:
                # A blob the registry already had (so we did not upload it) was old and unreferenced,
                # and garbage collection took it before this publish: upload what is missing, once.
                if exc.code != Codes.BLOB_MISSING or files_root is None or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def post_eval(self, model: str, version: str, artifact: str, result: PublishedEval) -> RecordedEval:
        """Record one runtime's eval of an artifact (`PublishedEval.of_report` makes one from an
        `EvalReport`); the registry's record of it comes back. An identical one again is accepted as is."""
        # What is None is not sent: a registry from before runtime_version refuses unknown fields, and one
        # from before metrics and gates were typed refuses null for them (it reads their absence as none).
        # model_dump_json, not model_dump(mode="json"): a NaN metric is sent as "NaN", which JSON can carry.
        body = {k: v for k, v in json.loads(result.model_dump_json()).items() if v is not None}
        path = f"{_artifact_path(model, version, artifact)}/evals"
        return RecordedEval.model_validate(self._json("POST", path, json=body))

    def artifact_evals(self, model: str, version: str, artifact: str) -> list[RecordedEval]:
        """Every runtime's eval of an artifact, as the registry recorded them (by runtime)."""
        return list(self.get_artifact(model, version, artifact).evals)

    # -- channels and resolve -------------------------------------------------------------------

    def promote(
        self,
        model: str,
        version: str,
        channel: str,
        force: bool = False,
        reason: str | None = None,
        actor: str | None = None,
    ) -> ChannelDetail:
        """Point `channel` at `model@version`; GateFailed if an artifact failed its eval and not forced."""
        body = {"version": version, "force": force, "reason": reason, "actor": actor}
        return self._answer(ChannelDetail, "POST", f"/v1/models/{_seg(model)}/channels/{_seg(channel)}", json=body)

    def set_split(
        self,
        model: str,
        channel: str,
        weights: dict[str, float],
        force: bool = False,
        reason: str | None = None,
        actor: str | None = None,
    ) -> ChannelDetail:
        """Split `channel`'s traffic over releases ({"1.4.0": 95, "1.5.0": 5}, percent); each passes the gates."""
        body = {
            "weights": [{"version": v, "weight": w} for v, w in weights.items()],
            "force": force,
            "reason": reason,
            "actor": actor,
        }
        path = f"/v1/models/{_seg(model)}/channels/{_seg(channel)}/split"
        return self._answer(ChannelDetail, "PUT", path, json=body)

    def resolve(
        self,
        model: str,
        hardware: str,
        channel: str = "prod",
        context: int = 4096,
        concurrency: int = 1,
        *,
        policy: str = "latency",
        kv_cache_dtype: str = "bf16",
        min_tokens_per_s: float | None = None,
        max_ttft_ms: float | None = None,
        key: str | None = None,
        version: str | None = None,
    ) -> ResolveOut:
        """The artifact a pool of `hardware` ("h100" or "h100:4,mi300x") should load from `channel`, why,
        and ranked fallbacks across the pools, by `policy`; `key` picks a stable release of a split,
        `version` names one of the channel's releases (VERSION_NOT_IN_CHANNEL if it is not)."""
        params: dict[str, str | int | float] = {
            "model": model,
            "hardware": hardware,
            "channel": channel,
            "context": context,
            "concurrency": concurrency,
            "policy": policy,
            "kv_cache_dtype": kv_cache_dtype,
        }
        optional = {"min_tokens_per_s": min_tokens_per_s, "max_ttft_ms": max_ttft_ms, "key": key, "version": version}
        params.update({k: v for k, v in optional.items() if v is not None})
        return self._answer(ResolveOut, "GET", "/v1/resolve", params=params)

    def oci_tags(self, repository: str) -> list[str]:
        """Every tag of one of the registry's OCI repositories (`<model>`, `modelcar/<model>`): its
        `/v2/<repository>/tags/list`. Errors carry the OCI codes (NAME_UNKNOWN, NAME_INVALID, DENIED)."""
        tags: list[str] = []
        for response in self._pages(f"/v2/{repository}/tags/list"):
            tags.extend(response.json()["tags"] or [])
        return tags

    # -- hardware catalog and measured performance -----------------------------------------------

    def hardware(self) -> list[HardwareOut]:
        """The registry's hardware catalog (built-in entries and the registry's own), by name."""
        return self._list(HardwareOut, "/v1/hardware")

    def hardware_entry(self, name: str) -> HardwareOut:
        """One SKU of the registry's catalog, with where its entry comes from."""
        return self._answer(HardwareOut, "GET", f"/v1/hardware/{_seg(name)}")

    def put_hardware(self, profile: HardwareProfile) -> HardwareOut:
        """Add SKU `profile.name` to the catalog or override its entry (admin)."""
        body = profile.model_dump(mode="json")
        return self._answer(HardwareOut, "PUT", f"/v1/hardware/{_seg(profile.name)}", json=body)

    def delete_hardware(self, name: str) -> None:
        """Remove the registry's entry for `name` (a built-in one returns to its default; admin)."""
        self._send("DELETE", f"/v1/hardware/{_seg(name)}")

    def post_performance(self, model: str, version: str, artifact: str, record: PerformanceCreate) -> PerformanceOut:
        """Record a measured performance of an artifact on one SKU (publish scope)."""
        path = f"{_artifact_path(model, version, artifact)}/performance"
        return self._answer(PerformanceOut, "POST", path, json=record.model_dump(mode="json"))

    # -- access control and audit ----------------------------------------------------------------

    def create_token(
        self, name: str, scopes: list[str], models: list[str] | None = None, expires_at: datetime | None = None
    ) -> TokenCreated:
        """A new API token; the response holds its secret (shown once). `expires_at` (aware) None: the
        server's longest token lifetime."""
        body: dict[str, str | list[str]] = {"name": name, "scopes": scopes, "models": models or []}
        if expires_at is not None:
            body["expires_at"] = expires_at.isoformat()
        return self._answer(TokenCreated, "POST", "/v1/tokens", json=body)

    def list_tokens(self) -> list[TokenOut]:
        return self._list(TokenOut, "/v1/tokens")

    def revoke_token(self, token_id: int, reason: str | None = None) -> TokenOut:
        return self._answer(TokenOut, "POST", f"/v1/tokens/{token_id}/revoke", json={"reason": reason})

    def yank(self, model: str, version: str, reason: str) -> ReleaseOut:
        """Yank a sealed release: kept, never resolved, downloaded or promoted again."""
        path = f"/v1/models/{_seg(model)}/releases/{_seg(version)}/yank"
        return self._answer(ReleaseOut, "POST", path, json={"reason": reason})

    def audit(self, model: str | None = None, limit: int = 100) -> list[AuditEventOut]:
        """The newest `limit` audit events (about `model`), newest first, over as many pages as that takes."""
        params: Query = {"limit": min(limit, MAX_PAGE_LIMIT)} | ({"model": model} if model else {})
        return self._list(AuditEventOut, "/v1/audit", params, most=limit)

    # -- signatures, provenance and trusted keys ---------------------------------------------------

    def attach_attestation(
        self, model: str, version: str, artifact: str, kind: AttestationKind, path: str | Path
    ) -> AttestationOut:
        """Upload a Sigstore bundle and attach it to an artifact as its `signature` or `provenance`."""
        blob = self.upload_blob(path)
        body = {"kind": kind, "sha256": blob.sha256, "size": blob.size}
        return self._answer(
            AttestationOut, "POST", f"{_artifact_path(model, version, artifact)}/attestations", json=body
        )

    def list_attestations(self, model: str, version: str, artifact: str) -> list[AttestationOut]:
        return self._list(AttestationOut, f"{_artifact_path(model, version, artifact)}/attestations")

    def get_artifact(self, model: str, version: str, artifact: str) -> ArtifactDetail:
        """An artifact's manifest, files (with download URLs) and evals."""
        return self._answer(ArtifactDetail, "GET", _artifact_path(model, version, artifact))

    def download(self, url_path: str, dest: str | Path) -> None:
        """Stream a registry path (a file or an attestation of an artifact) to `dest` (via a temp file)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            with self._http.stream("GET", url_path, follow_redirects=True) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from_response(response)
                with open(tmp, "wb") as out:
                    for chunk in response.iter_bytes(CHUNK):
                        out.write(chunk)
        except httpx2.TransportError as exc:
            raise Unavailable(f"registry {self.location} unreachable: {exc}") from exc
        tmp.replace(dest)

    def download_artifact(self, model: str, version: str, artifact: str, dest: str | Path) -> ArtifactDetail:
        """Download an artifact's files and its attestations (as `model.sig`, `provenance.sigstore.json`)
        into `dest`; returns the artifact's detail."""
        detail = self.get_artifact(model, version, artifact)
        base = _artifact_path(model, version, artifact)
        for f in detail.files:
            check_relative_path(f.path)
            self.download(f"{base}/files/{quote(f.path, safe='/')}", Path(dest) / f.path)
        for a in self.list_attestations(model, version, artifact):
            self.download(f"{base}/attestations/{a.kind}", Path(dest) / ATTESTATION_FILES[a.kind])
        return detail

    def add_key(self, public_key_pem: str, model_pattern: str) -> TrustedKeyOut:
        """Trust a publisher public key for models matching `model_pattern` (admin)."""
        body = {"public_key_pem": public_key_pem, "model_pattern": model_pattern}
        return self._answer(TrustedKeyOut, "POST", "/v1/keys", json=body)

    def list_keys(self) -> list[TrustedKeyOut]:
        return self._list(TrustedKeyOut, "/v1/keys")

    def revoke_key(self, key_id: str, reason: str | None = None) -> TrustedKeyOut:
        return self._answer(TrustedKeyOut, "POST", f"/v1/keys/{_seg(key_id)}/revoke", json={"reason": reason})


@functools.cache
def _rows_of(record: type[Answer]) -> TypeAdapter[list[Answer]]:
    """The reader of a page of `record`s: built once per record type (building one is the costly part)."""
    return TypeAdapter(list[record])  # type: ignore[valid-type]


def _artifact_path(model: str, version: str, artifact: str) -> str:
    return f"/v1/models/{_seg(model)}/releases/{_seg(version)}/artifacts/{_seg(artifact)}"
