"""Registry settings, read from the environment with the prefix `KILN_REGISTRY_`."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kiln.core.errors import InvalidInput

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# One label of a host name, lowercased (underscores too: internal names have them).
HOST_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")


@dataclass(frozen=True)
class AllowList:
    """The operator's admitted internal webhook receivers (`webhook_allow`): networks, and host:port pairs.

    Here, with the setting it parses, so that reading the settings needs nothing of the webhooks that use it
    (`registry.webhooks.destinations`).
    """

    networks: tuple[IPNetwork, ...] = ()
    endpoints: frozenset[tuple[str, int]] = frozenset()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        """ValueError, naming the entry, unless each is a network/address or a host:port."""
        networks: list[IPNetwork] = []
        endpoints: set[tuple[str, int]] = set()
        for entry in entries:
            text = entry.strip().lower()
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            host, colon, port = text.rpartition(":")
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            if colon and port.isdigit() and 0 < int(port) < 65536 and host:
                try:
                    host = str(ipaddress.ip_address(host))
                except ValueError:
                    if not all(HOST_LABEL.fullmatch(label) for label in host.removesuffix(".").split(".")):
                        host = ""
                if host:
                    endpoints.add((host.removesuffix("."), int(port)))
                    continue
            raise ValueError(
                f"webhook allow-list entry {entry!r} is neither a network (10.0.0.0/8, 127.0.0.1, fd00::/8) "
                "nor a host:port (hooks.internal:8443, [::1]:9000)"
            )
        return cls(tuple(networks), frozenset(endpoints))

    def admits_endpoint(self, host: str, port: int) -> bool:
        return (host, port) in self.endpoints

    def admits(self, address: IPAddress, port: int) -> bool:
        return any(address in network for network in self.networks) or (str(address), port) in self.endpoints


class RegistrySettings(BaseSettings):
    """Where the registry keeps its database and blobs, and how it names itself in URLs.

    Left unset, `database_url` and `blob_url` point inside `data_dir` (the embedded registry:
    SQLite + local disk); that embedded database is migrated on startup, an explicit
    `database_url` never is (run `python -m kiln.registry.migrate upgrade` / `kiln db upgrade`).
    """

    model_config = SettingsConfigDict(env_prefix="KILN_REGISTRY_", extra="ignore")

    data_dir: Path = Field(default=Path(".kiln/registry"), description="embedded registry directory")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default sqlite:///<data_dir>/registry.db (embedded)"
    )
    blob_url: str | None = Field(
        default=None,
        description="blob store URI by scheme: file:///dir or s3://bucket/prefix; default file://<data_dir>/blobs",
    )
    # S3 (blob_url s3://...): region and credentials come from the standard AWS environment.
    s3_endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, Ceph, ...); default: AWS S3 for the region"
    )
    s3_downloads: Literal["stream", "redirect"] = Field(
        default="stream",
        description="stream: bytes flow through the registry; redirect: 307 to a presigned S3 URL",
    )
    s3_presign_expiry_s: int = Field(default=3600, ge=60, le=7 * 24 * 3600, description="presigned URL lifetime")
    s3_part_size: int = Field(
        default=64 * 1024**2, ge=5 * 1024**2, le=5 * 1024**3, description="multipart upload part size (bytes)"
    )
    blob_gc_grace_hours: float = Field(
        default=24.0, ge=0, description="`kiln gc` spares unreferenced blobs uploaded more recently than this"
    )
    public_url: str | None = Field(
        default=None, description="base URL for download links; default: the URL the request came to"
    )
    max_upload_bytes: int = Field(default=256 * 1024**3, gt=0, description="largest accepted blob upload")
    max_body_bytes: int = Field(
        default=4 * 1024**2,
        gt=0,
        description="largest accepted request body other than a blob upload (JSON): the limit of an artifact "
        "manifest or a release, and a cap on every other route's own (64 KiB unless registry.api.boundary says more)",
    )
    request_threads: int = Field(
        default=8,
        ge=1,
        le=1000,
        description="threads each server process runs requests' blocking work on (database, disk) at once; the "
        "others wait their turn without a thread. More threads than the cores can run only contend for the "
        "interpreter with the event loop (bench/soak.py on PostgreSQL, 2 cores: /healthz p99 217 ms with 40, "
        "74 ms with 8, and 58 % more requests served)",
    )
    auth_required: bool = Field(
        default=True,
        description="requests need API tokens with scopes; off only for the in-process embedded registry",
    )
    anonymous_read: bool = Field(default=True, description="reads (list, resolve, download) without a token")
    token_max_lifetime_days: float | None = Field(
        default=365.0,
        gt=0,
        le=36_500,
        description="the longest an API token may live; a token created without an expiry gets this one "
        "(null: tokens may be made to never expire)",
    )
    opentelemetry: bool = Field(
        default=False,
        description="FastAPI's own OpenTelemetry spans, metrics and logs for every request, to the process's "
        "configured providers (or those FASTAPI_OTEL_AUTO_CONFIGURE sets up from OTEL_* variables); off, no "
        "request looks for a provider",
    )
    protected_channels: list[str] = Field(
        default_factory=lambda: ["prod"], description="channels whose promotion needs the `promote` scope"
    )
    signed_channels: list[str] = Field(
        default_factory=list,
        description="channels that serve only artifacts signed by a trusted key, for every model (models with "
        "trusted keys need signatures on every channel anyway); e.g. the protected channels",
    )
    modelcar_base: Path | None = Field(
        default=None,
        description="OCI image layout of the base image (with a shell) that model cars (`modelcar/<model>`) are "
        "built on; unset: no model cars",
    )
    modelcar_platform: str = Field(
        default="linux/amd64", pattern=r"^[a-z0-9]+/[a-z0-9]+$", description="the base image's os/architecture"
    )
    webhook_delivery: bool = Field(
        default=True, description="this process sends webhook deliveries (off: it only queues them, others send)"
    )
    webhook_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="a webhook delivery attempt's time limit, connect to response"
    )
    webhook_max_attempts: int = Field(
        default=8, ge=1, le=100, description="attempts at a webhook delivery before it is marked failed"
    )
    webhook_backoff_base_s: float = Field(
        default=10.0, gt=0, description="wait after a failed attempt n: base * 2^(n-1), capped at webhook_backoff_max_s"
    )
    webhook_backoff_max_s: float = Field(default=3600.0, gt=0, description="longest wait between delivery attempts")
    webhook_poll_interval_s: float = Field(
        default=2.0, gt=0, le=300, description="how often each server process looks for due webhook deliveries"
    )
    webhook_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="internal webhook receivers, which are refused unless listed: networks (10.0.0.0/8, 127.0.0.1) "
        "and host:port pairs (hooks.internal:8443), comma-separated or a JSON list; unspecified, multicast and "
        "cloud metadata addresses are refused even if listed",
    )

    @field_validator("webhook_allow", mode="before")
    @classmethod
    def _allow_entries(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the environment
            value = (
                json.loads(value)
                if value.lstrip().startswith("[")
                else [e.strip() for e in value.split(",") if e.strip()]
            )
        if isinstance(value, list):
            AllowList.parse(str(e) for e in value)  # a ValueError names the bad entry
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then `KILN_REGISTRY_*` variables, then the YAML file named by `KILN_REGISTRY_CONFIG`."""
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        config_file = os.environ.get("KILN_REGISTRY_CONFIG")
        if config_file:
            if not Path(config_file).is_file():
                raise InvalidInput(f"KILN_REGISTRY_CONFIG names {config_file!r}, which is not a file")
            sources += (YamlConfigSettingsSource(settings_cls, yaml_file=config_file),)
        return sources

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
