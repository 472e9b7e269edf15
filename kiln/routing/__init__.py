"""Routing for the routers people run: a channel's releases, placed on hardware pools as the registry resolves
them, rendered as the objects of a router's own API.

`gather` reads the placements through the client (resolve for each release on each pool) into the
records of `records`; each format module (`gateway_api`: the Gateway API Inference Extension, `kserve`:
KServe) registers itself in `formats` and renders those records, purely, into documents; `runtimes` says
which runtime serves an artifact and how it is sized; `names` makes Kubernetes names and labels.
`render_channel` is the whole of it, as `kiln routing render` and examples/routing-webhook call it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.client import RegistryClient
from kiln.core.errors import OutputPathInvalid
from kiln.routing import gateway_api, kserve  # noqa: F401 - each registers its format
from kiln.routing.formats import FORMATS, Document, get_format, to_yaml
from kiln.routing.gather import gather_routing
from kiln.routing.records import ChannelRouting, RenderOptions, Sizing

__all__ = [
    "FORMATS",
    "ChannelRouting",
    "RenderOptions",
    "Rendered",
    "Sizing",
    "check_output",
    "render_channel",
    "write_atomically",
]


@dataclass(frozen=True)
class Rendered:
    """A channel's routing in one router's format: the records, the documents, and their YAML."""

    routing: ChannelRouting
    documents: list[Document]
    text: str


def render_channel(
    client: RegistryClient,
    model: str,
    channel: str,
    format: str,
    pools: Sequence[str],
    sizing: Sizing | None = None,
    options: RenderOptions | None = None,
) -> Rendered:
    """`model`'s `channel` on `pools` (`h100:8`), as the registry resolves it now, in router format `format`."""
    fmt = get_format(format)  # an unknown format is refused before the registry is asked anything
    options = options or RenderOptions()
    routing = gather_routing(client, model, channel, pools, sizing or Sizing(), modelcars=fmt.needs_modelcars)
    documents = fmt.render(routing, options)
    return Rendered(routing, documents, to_yaml(fmt, routing, documents))


def check_output(path: Path) -> None:
    """OUTPUT_PATH_INVALID unless `path` is a regular file or nothing yet, in a directory or where one can be."""
    where = {"path": str(path)}
    if path.exists() and not path.is_file():
        raise OutputPathInvalid(f"{path}: not a regular file, so it cannot be written", details=where)
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise OutputPathInvalid(f"{path}: {parent} is not a directory", details=where)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it: a reader (kubectl, a GitOps agent) sees the
    old file or the new one, never half of one."""
    check_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
