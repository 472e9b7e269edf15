"""`kiln hardware list|set|delete|probe` and `kiln performance`: the catalog resolve sizes with, and measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.common import DEFAULT_REGISTRY, JsonOpt, RegistryOpt, answer, app, emit, hardware_app, split_ref
from kiln.client import RegistryClient
from kiln.console import err, safe_text, stdout
from kiln.core.datafile import parse_record, read_mapping
from kiln.core.device import resolve_device
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.hardware import HardwareCatalog, HardwareProfile, builtin_catalog, parse_entry
from kiln.core.performance import PerformanceCreate
from kiln.probe import ProbeReport, ProbeRun, device_name, efficiency, identify, measure, table


@hardware_app.command("list")
def hardware_list(registry: RegistryOpt = DEFAULT_REGISTRY, as_json: JsonOpt = False) -> None:
    """Every SKU of the registry's catalog: memory, bandwidth, FLOP/s, node, price, and where the entry comes from."""
    with RegistryClient.connect(registry) as client:
        rows = client.hardware()
    if as_json:
        emit(rows)
        return
    for h in rows:
        price = f"${h.price_per_device_hour:g}/h" if h.price_per_device_hour is not None else "no price"
        fp8 = h.fp8 or "no fp8"
        stdout.print(
            safe_text(
                f"{h.name:<10} {h.family:<5} {h.arch:<8} {h.memory_gib:>6g} GiB "
                f"{h.bandwidth_gbs:>6g} GB/s bf16 {h.tflops.bf16:>6g} TFLOP/s {fp8:<8} "
                f"×{h.devices_per_node:<2} {price:<12} {h.source}"
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
    profile = parse_entry(name, read_mapping(entry, "a hardware entry"))
    with RegistryClient.connect(registry) as client:
        out = client.put_hardware(profile)
    answer(out, as_json, f"hardware {name}: {out.source}")


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


def _registry_catalog(client: RegistryClient) -> HardwareCatalog:
    """The registry's catalog as it serves it (its own entries over the built-in ones)."""
    return HardwareCatalog(HardwareProfile.model_validate(e.model_dump(exclude={"source"})) for e in client.hardware())


def _saved_run(path: Path) -> ProbeRun:
    """A run printed by `kiln hardware probe --json` (the whole document, or its `run`)."""
    data = read_mapping(path, "a probe run (kiln hardware probe --json)")
    return parse_record(ProbeRun, data.get("run", data), f"{path}: not a probe run")


@hardware_app.command("probe")
def hardware_probe(
    hardware: Annotated[
        str | None,
        typer.Option(
            "--hardware",
            help="The SKU this node's device is (default: the catalog entry whose products name the GPU, else cpu).",
            show_default=False,
        ),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="auto (the first CUDA device, else the CPU), cpu, cuda or cuda:N.")
    ] = "auto",
    publish: Annotated[
        bool,
        typer.Option(
            "--publish",
            help="Record the shares as the SKU's `measured` record in the registry's catalog (admin; audited).",
        ),
    ] = False,
    saved: Annotated[
        Path | None,
        typer.Option(
            "--from", help="A run printed by --json, to show or publish instead of measuring.", show_default=False
        ),
    ] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Measure the shares of an SKU's data-sheet peaks this node's device reaches: memory read, a decode chain and
    matmuls per type, allocatable memory. With --publish, resolve bounds that SKU by them."""
    loaded = _saved_run(saved) if saved is not None else None  # a bad file is refused before the registry is opened
    client = RegistryClient.connect(registry) if publish else None
    try:
        # Against the peaks of the entry the shares are published to: the registry's where it has its own.
        catalog = _registry_catalog(client) if client is not None else builtin_catalog()
        if loaded is not None:
            run = loaded
            profile = identify(run.device_name, run.device.startswith("cuda"), catalog, hardware)
        else:
            where = resolve_device(device)
            profile = identify(device_name(where), where.is_cuda, catalog, hardware)
            run = measure(where, profile)
        record, rows, problems = efficiency(run, profile)
        out = ProbeReport(
            hardware=profile.name,
            run=run,
            readings=[row.as_reading() for row in rows],
            measured=record,
            problems=problems,
        )
        if client is not None:
            if record is None or problems:
                raise InvalidInput(
                    f"hardware {profile.name}: not published, the run is not a whole record: {'; '.join(problems)}",
                    code=Codes.PROBE_INCOMPLETE,
                    details={"hardware": profile.name, "problems": problems},
                )
            entry = client.hardware_entry(profile.name)
            put = client.put_hardware(entry.model_copy(update={"measured": record}))
            out = out.model_copy(update={"published": put.source})
    finally:
        if client is not None:
            client.close()
    if as_json:
        emit(out)
        return
    for line in table(run, profile, rows):
        stdout.print(safe_text(line))
    for problem in problems:
        err.print(safe_text(f"left out: {problem}"))
    if out.published is not None:
        err.print(safe_text(f"hardware {profile.name}: measured shares recorded ({out.published})"))


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
    measured = parse_record(PerformanceCreate, read_mapping(record, "a performance record"), "a performance record")
    with RegistryClient.connect(registry) as client:
        out = client.post_performance(model, version, artifact, measured)
    answer(
        out,
        as_json,
        f"{model}@{version}/{artifact} on {out.hardware} (TP {out.tp}): {out.tokens_per_s:g} tokens/s recorded",
    )
