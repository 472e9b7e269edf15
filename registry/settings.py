"""Registry settings, read from the environment with the prefix `KILN_REGISTRY_`."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class RegistrySettings(BaseSettings):
    """Where the registry keeps its database and blobs, and how it names itself in URLs.

    Left unset, `database_url` and `blob_url` point inside `data_dir` (the embedded registry:
    SQLite + local disk); that embedded database is migrated on startup, an explicit
    `database_url` never is (run `python -m registry.migrate upgrade` / `kiln db upgrade`).
    """

    model_config = SettingsConfigDict(env_prefix="KILN_REGISTRY_", extra="ignore")

    data_dir: Path = Field(default=Path(".kiln/registry"), description="embedded registry directory")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default sqlite:///<data_dir>/registry.db (embedded)"
    )
    blob_url: str | None = Field(
        default=None, description="blob store URI, chosen by scheme (file://); default file://<data_dir>/blobs"
    )
    public_url: str | None = Field(
        default=None, description="base URL for download links; default: the URL the request came to"
    )
    max_upload_bytes: int = Field(default=256 * 1024**3, gt=0, description="largest accepted blob upload")
    auth_required: bool = Field(
        default=True,
        description="requests need API tokens with scopes; off only for the in-process embedded registry",
    )
    anonymous_read: bool = Field(default=True, description="reads (list, resolve, download) without a token")
    protected_channels: list[str] = Field(
        default_factory=lambda: ["prod"], description="channels whose promotion needs the `promote` scope"
    )

    @property
    def is_embedded(self) -> bool:
        """True when the database is the default SQLite file inside `data_dir`."""
        return self.database_url is None

    def effective_database_url(self) -> str:
        if self.database_url is not None:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'registry.db').resolve()}"

    def effective_blob_url(self) -> str:
        if self.blob_url is not None:
            return self.blob_url
        return (self.data_dir / "blobs").resolve().as_uri()
