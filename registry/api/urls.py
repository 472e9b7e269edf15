"""Absolute URLs the API hands out (download links)."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import Request

from registry.settings import RegistrySettings


def base_url(request: Request, settings: RegistrySettings) -> str:
    """`public_url` when configured (behind a proxy), else the URL this request came to."""
    return (settings.public_url or str(request.base_url)).rstrip("/")


def artifact_file_url(base: str, model: str, version: str, artifact: str, path: str) -> str:
    return (
        f"{base}/v1/models/{quote(model, safe='')}/releases/{quote(version, safe='')}"
        f"/artifacts/{quote(artifact, safe='')}/files/{quote(path, safe='/')}"
    )
