"""`kiln routing render`: a channel's releases, placed on hardware pools as the registry resolves them, as the
objects of a router's own API (kiln.routing)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.common import DEFAULT_REGISTRY, RegistryOpt, routing_app
from kiln.client import RegistryClient
from kiln.console import err, safe_text
from kiln.routing import FORMATS, RenderOptions, Sizing, check_output, render_channel, write_atomically
from kiln.routing.formats import get_format
from kiln.routing.gather import parse_pool_options


@routing_app.command("render")
def render(
    model: str,
    format: Annotated[str, typer.Option("--format", help=f"Router format: {' | '.join(sorted(FORMATS))}.")],
    pool: Annotated[
        list[str] | None,
        typer.Option("--pool", help="A hardware pool with its free devices, e.g. h100:8 (repeat for each pool)."),
    ] = None,
    channel: Annotated[
        str, typer.Option(help="Channel to render: its release, or every release of its split.")
    ] = "prod",
    context: Annotated[int, typer.Option(help="Context length each replica is sized for.")] = 4096,
    concurrency: Annotated[int, typer.Option(help="Concurrent sequences per replica.")] = 1,
    policy: Annotated[str, typer.Option(help="latency | cost | quality: how resolve chooses each pool's artifact.")] = (
        "latency"
    ),
    kv_cache_dtype: Annotated[str, typer.Option(help="bf16 | fp8.")] = "bf16",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace of the objects.")] = "default",
    target_port: Annotated[int, typer.Option(help="gateway-api: the model servers' port.")] = 8000,
    endpoint_picker: Annotated[
        str | None, typer.Option(help="gateway-api: the endpoint picker's Service (default <pool>-epp).")
    ] = None,
    endpoint_picker_port: Annotated[int, typer.Option(help="gateway-api: the endpoint picker's port.")] = 9002,
    priority: Annotated[
        int | None, typer.Option(help="gateway-api: an InferenceObjective per pool with this priority.")
    ] = None,
    oci_host: Annotated[
        str | None, typer.Option(help="kserve: the registry's host:port as the cluster pulls model cars from it.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the YAML here (default: standard output).")] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
) -> None:
    """MODEL's CHANNEL on each --pool as a router's objects, annotated with what kiln resolved and why."""
    get_format(format)  # bad input is refused before the registry is opened
    if out is not None:
        check_output(out)
    pools = pool or []
    parse_pool_options(pools)
    sizing = Sizing.of(context=context, concurrency=concurrency, policy=policy, kv_cache_dtype=kv_cache_dtype)
    options = RenderOptions(
        namespace=namespace,
        target_port=target_port,
        endpoint_picker=endpoint_picker,
        endpoint_picker_port=endpoint_picker_port,
        priority=priority,
        oci_host=oci_host,
    )
    with RegistryClient.connect(registry) as client:
        rendered = render_channel(client, model, channel, format, pools, sizing, options)
    if out is None:
        typer.echo(rendered.text, nl=False)
        return
    write_atomically(out, rendered.text)
    split = ", ".join(f"{v} {w / 100:g} %" for v, w in rendered.routing.split)
    err.print(safe_text(f"{out}: {len(rendered.documents)} objects for {model} channel {channel} ({split})"))
