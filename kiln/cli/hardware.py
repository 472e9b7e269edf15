"""`kiln hardware list|set|delete` and `kiln performance`: the catalog resolve sizes with, and measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from client import RegistryClient
from core.errors import InvalidInput
from kiln.cli.common import DEFAULT_REGISTRY, JsonOpt, RegistryOpt, answer, app, emit, hardware_app, split_ref
from kiln.console import safe_text, stdout


def _read_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML or JSON file holding one mapping."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InvalidInput(f"{path}: cannot read {what}: {e}", code="INVALID_INPUT") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: {what} must be a mapping of fields", code="INVALID_INPUT")
    return data


@hardware_app.command("list")
def hardware_list(registry: RegistryOpt = DEFAULT_REGISTRY, as_json: JsonOpt = False) -> None:
    """Every SKU of the registry's catalog: memory, bandwidth, FLOP/s, node, price, and where the entry comes from."""
    with RegistryClient.connect(registry) as client:
        rows = client.hardware()
    if as_json:
        emit(rows)
        return
    for h in rows:
        price = f"${h['price_per_device_hour']:g}/h" if h.get("price_per_device_hour") is not None else "no price"
        fp8 = h.get("fp8") or "no fp8"
        stdout.print(
            safe_text(
                f"{h['name']:<10} {h['family']:<5} {h['arch']:<8} {h['memory_gib']:>6g} GiB "
                f"{h['bandwidth_gbs']:>6g} GB/s bf16 {h['tflops']['bf16']:>6g} TFLOP/s {fp8:<8} "
                f"×{h['devices_per_node']:<2} {price:<12} {h['source']}"
            )
        )


@hardware_app.command("set")
def hardware_set(
    name: Annotated[str, typer.Argument(help="SKU name, e.g. h20.")],
    entry: Annotated[Path, typer.Argument(help="YAML or JSON file with the entry (as `kiln hardware list --json`).")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Add an SKU to the registry's catalog, or override its entry (admin; audited)."""
    with RegistryClient.connect(registry) as client:
        out = client.put_hardware(name, _read_mapping(entry, "a hardware entry"))
    answer(out, as_json, f"hardware {name}: {out['source']}")


@hardware_app.command("delete")
def hardware_delete(
    name: Annotated[str, typer.Argument(help="SKU name.")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Remove the registry's entry for an SKU (a built-in one returns to its default; admin; audited)."""
    with RegistryClient.connect(registry) as client:
        client.delete_hardware(name)
    answer({"name": name, "deleted": True}, as_json, f"hardware {name}: registry entry removed")


@app.command()
def performance(
    ref: Annotated[str, typer.Argument(metavar="MODEL@VERSION")],
    artifact: Annotated[str, typer.Argument(help="Artifact name, e.g. hf-bundle-fp8.")],
    record: Annotated[
        Path,
        typer.Argument(
            help="YAML or JSON file: hardware, runtime, runtime_version, tp, context, concurrency, tokens_per_s, "
            "ttft_ms, itl_p50_ms, itl_p99_ms."
        ),
    ],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Record a measured serving performance of an artifact on one SKU (resolve prefers it to its estimates)."""
    model, version = split_ref(ref)
    with RegistryClient.connect(registry) as client:
        out = client.post_performance(model, version, artifact, _read_mapping(record, "a performance record"))
    answer(
        out,
        as_json,
        f"{model}@{version}/{artifact} on {out['hardware']} (TP {out['tp']}): {out['tokens_per_s']:g} tokens/s "
        f"recorded",
    )
