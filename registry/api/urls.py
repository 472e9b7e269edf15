"""Absolute URLs the API hands out (download links)."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import Request

from kiln.registry.settings import RegistrySettings

# The base URL per (scheme, server, root path, Host header) a request came with: Starlette's parsing
# of them (host validation included) costs more than a warm resolve's own work. Bounded: cleared
# when full, since the Host header is the caller's to choose.
_BASES: dict[tuple[object, ...], str] = {}
_MAX_BASES = 256


def base_url(request: Request, settings: RegistrySettings) -> str:
    """`public_url` when configured (behind a proxy), else the URL this request came to."""
    if settings.public_url:
        return settings.public_url.rstrip("/")
    scope = request.scope
    host = next((value for name, value in scope["headers"] if name == b"host"), None)
    key = (
        scope.get("scheme"),
        tuple(scope.get("server") or ()),
        scope.get("app_root_path", scope.get("root_path")),
        host,
    )
    base = _BASES.get(key)
    if base is None:
        if len(_BASES) >= _MAX_BASES:
            _BASES.clear()
        base = _BASES[key] = str(request.base_url).rstrip("/")
    return base


def artifact_file_url(base: str, model: str, version: str, artifact: str, path: str) -> str:
    return (
        f"{base}/v1/models/{quote(model, safe='')}/releases/{quote(version, safe='')}"
        f"/artifacts/{quote(artifact, safe='')}/files/{quote(path, safe='/')}"
    )
