"""The shares of its data-sheet peaks this machine's device reaches: `kiln hardware probe`'s measurement, recorded.

    python bench/hardware_probe.py [--device auto|cpu|cuda|cuda:N] [--hardware NAME]

Runs kiln/probe.py's measurement (what `kiln hardware probe --json` prints) on the device against the built-in
catalog entry of its SKU (`--hardware`, else the entry whose products name the GPU, else cpu): a memory read of
a buffer far larger than any cache, a decode-like chain (M=1 over bf16 weights, and FP8 weights through
torch._scaled_mm on a CUDA device with FP8 units), GEMMs at large and small M per type the device runs, and the
memory one process can allocate. Prints a table (median, best, catalog peak, share) and appends the record (the
device's name, the readings, the catalog's `measured` record they make, the wall time with torch's import) to
bench/results/hardware_probe.jsonl. bench/gpu_check.py runs the same on a GPU machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def probe(device: str = "auto", hardware: str | None = None) -> dict[str, Any]:
    """Measure `device` as its catalog SKU: the run, its rows against the entry's peaks, the record, the time."""
    started = time.perf_counter()
    import torch  # noqa: F401 - timed with the run: what `kiln hardware probe` pays too

    from kiln.core.device import resolve_device
    from kiln.core.hardware import builtin_catalog
    from kiln.probe import device_name, efficiency, identify, measure

    imported = time.perf_counter() - started
    where = resolve_device(device)
    profile = identify(device_name(where), where.is_cuda, builtin_catalog(), hardware)
    run = measure(where, profile)
    record, rows, problems = efficiency(run, profile)
    return {
        "hardware": profile.name,
        "device_name": run.device_name,
        "run": run.model_dump(mode="json"),
        "readings": [row.as_dict() for row in rows],
        "measured": record.model_dump(mode="json") if record is not None else None,
        "problems": problems,
        "import_s": round(imported, 2),
        "wall_s": round(time.perf_counter() - started, 2),
    }


def table(doc: dict[str, Any]) -> list[str]:
    """The probe's readings as a markdown table."""
    run = doc["run"]
    lines = [
        f"{doc['device_name']} ({run['device']}, {run['runtime']}) as {doc['hardware']}: measured in "
        f"{run['seconds']} s, {doc['wall_s']} s with torch's import; {run['timer']}",
        "",
        "| reading | median | best | catalog peak | share | how |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in doc["readings"]:
        peak = f"{r['peak']:,g} {r['unit']}" if r["peak"] is not None else "—"
        share = f"{r['fraction']:.3f}" if r["fraction"] is not None else "—"
        lines.append(
            f"| {r['key']} | {r['median']:,.2f} {r['unit']} | {r['best']:,.2f} | {peak} | {share} | {r['what']} |"
        )
    if run["allocatable_gib"] is not None:
        lines.append(f"| allocatable | {run['allocatable_gib']:,.1f} GiB | | | | one process |")
    lines += [f"| {key} | not measured | | | | {why} |" for key, why in run["skipped"].items()]
    lines += [f"left out of the record: {p}" for p in doc["problems"]]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (the first CUDA device, else the CPU), cpu, cuda, cuda:N")
    ap.add_argument("--hardware", help="the SKU (default: the catalog entry whose products name the GPU, else cpu)")
    add_record_argument(ap, "hardware_probe")
    args = ap.parse_args()
    doc = probe(args.device, args.hardware)
    print("\n".join(table(doc)))
    save_record(run_record(benchmark="hardware_probe", **doc), args.record)


if __name__ == "__main__":
    main()
