"""What every benchmark records beside its results, and where: one JSON line per run (see README.md)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def add_record_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """`--record FILE`, by default bench/results/<name>.jsonl: where `save_record` appends the run."""
    parser.add_argument(
        "--record", type=Path, default=RESULTS / f"{name}.jsonl", help="append the run's JSON record here"
    )


# The CPU features that change what a benchmark measures (bf16 matmuls, AMX tiles, 512-bit vectors).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "sha_ni", "avx512_vnni")


def cpu() -> dict[str, Any]:
    """The CPU model and the flags of CPU_FLAGS it has (from /proc/cpuinfo)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "", platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags], "avx512": "avx512f" in flags}


def commit() -> str | None:
    """The checkout's commit, with "+changes" when files differ from it; None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        # The records themselves (bench/results) are not a change to what is measured.
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"]
        dirty = subprocess.run(status, cwd=root, capture_output=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def run_record(**fields: Any) -> dict[str, Any]:
    """The run's context (when, commit, host, CPU kind, cores, load, the command), then the benchmark's fields."""
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": commit(),
        "host": platform.node(),
        "cpu": cpu(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m": os.getloadavg()[0],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **fields,
    }


def save_record(record: dict[str, Any], path: Path | None) -> None:
    """Print the record as JSON and, given a path, append it there as one line."""
    print(json.dumps(record))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
