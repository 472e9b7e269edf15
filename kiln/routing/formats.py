"""The router formats, each registered once by name with the Kubernetes APIs it writes, and the YAML they
are written as: a header naming the channel, the sizing and the API sources, then one document per object.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from kiln.core.error_codes import Codes
from kiln.core.errors import UnknownName
from kiln.routing.records import ChannelRouting, RenderOptions

# A Kubernetes or KServe document as the renderer writes it: YAML for another system's schema, open by nature.
Document = dict[str, Any]


@dataclass(frozen=True)
class ApiSource:
    """A Kubernetes API a format writes, and where its CRD is defined (what the tests validate against)."""

    api_version: str
    kinds: tuple[str, ...]
    repository: str
    ref: str
    commit: str
    path: str

    def describe(self) -> str:
        return (
            f"{self.api_version} {', '.join(self.kinds)}: {self.repository} {self.ref} ({self.commit[:8]}), {self.path}"
        )


@dataclass(frozen=True)
class RouterFormat:
    """A router's format: its name, its APIs, and the pure function that renders a channel's routing."""

    name: str
    router: str  # for people: the routers that read it
    apis: tuple[ApiSource, ...]
    render: Callable[[ChannelRouting, RenderOptions], list[Document]]
    needs_modelcars: bool = False  # its objects pull the registry's model cars


FORMATS: dict[str, RouterFormat] = {}


def register(fmt: RouterFormat) -> RouterFormat:
    if fmt.name in FORMATS:
        raise ValueError(f"router format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> RouterFormat:
    """The format named `name`; ROUTING_FORMAT_UNKNOWN lists the known ones."""
    if name not in FORMATS:
        raise UnknownName(
            f"unknown routing format {name[:40]!r}; known: {', '.join(sorted(FORMATS))}",
            code=Codes.ROUTING_FORMAT_UNKNOWN,
            details={"format": name[:200], "known": sorted(FORMATS)},
        )
    return FORMATS[name]


def to_yaml(fmt: RouterFormat, routing: ChannelRouting, documents: list[Document]) -> str:
    """The documents as one YAML stream, after a header saying what they were rendered from.

    One value per line, however long (annotations hold JSON): a changed value is a changed line. Nothing
    in it depends on when it was rendered, so an unchanged channel renders the same bytes."""
    pools = ", ".join(p.hardware + (f":{p.free_devices}" if p.free_devices is not None else "") for p in routing.pools)
    header = [
        f"Rendered by `kiln routing render --format {fmt.name}` for {fmt.router}.",
        f"Model {routing.model}, channel {routing.channel}, registry {routing.registry}.",
        f"Pools {pools}; each replica sized for {routing.sizing.describe()}.",
        "APIs (each document is validated against its CRD's openAPIV3Schema in kiln's tests):",
        *(f"  {api.describe()}" for api in fmt.apis),
        "Render again when the channel changes: webhook events channel.promote and channel.split.",
    ]
    # Through JSON: plain values only, and no object shared between documents (YAML would alias it).
    plain = json.loads(json.dumps(documents))
    body = yaml.safe_dump_all(
        plain, explicit_start=True, sort_keys=False, default_flow_style=False, width=1_000_000, allow_unicode=True
    )
    return "".join(f"# {line}\n" for line in header) + body
