"""Benchmark: the example release's full build from a fresh work directory, wall time by stage kind.

    python bench/example_build.py [--recipe examples/tiny-llama/kiln.yaml]

Runs `kiln build RECIPE --json` in a fresh process into an empty temporary work directory (nothing
cached), under `/usr/bin/time -v` for the peak RSS, and sums the report's `stage_seconds` by stage
kind (quantize/w4a16-awq and quantize/w4a16-gptq apart: they are most of the quantize time). The
calibration dtype the build chose for this CPU is read from the quantize stage's record. Target
(DESIGN.md): <= 90 s on any x86-64 CPU kind of 2 cores.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 90.0
CALIBRATED = ("quantize/w4a16-awq", "quantize/w4a16-gptq")


def by_kind(stage_seconds: dict[str, float]) -> dict[str, dict[str, float]]:
    """{kind: {"stages": n, "seconds": s}}; a stage's kind is its id up to the slash, the calibrated
    quantize stages each their own."""
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"stages": 0, "seconds": 0.0})
    for node, seconds in stage_seconds.items():
        kind = node if node in CALIBRATED else node.split("/", 1)[0]
        kinds[kind]["stages"] += 1
        kinds[kind]["seconds"] += seconds
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]["seconds"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "examples/tiny-llama/kiln.yaml")
    add_record_argument(ap, "example_build")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kiln-bench-build-") as tmp:
        work = Path(tmp) / "work"
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "kiln", "build", str(args.recipe)]
        cmd += ["--work-dir", str(work), "--json"]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            sys.exit(f"kiln build failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        report = json.loads(proc.stdout)
        peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        dtypes = {
            json.loads(p.read_text())["result"]["calibration"]["compute_dtype"]
            for p in work.glob("quantize/*/stage.json")
            if json.loads(p.read_text())["result"].get("calibration")
        }
    kinds = by_kind(report["stage_seconds"])
    stages = report["stages"]
    print(f"{'stage kind':>22} {'stages':>7} {'seconds':>8}")
    for kind, row in kinds.items():
        print(f"{kind:>22} {int(row['stages']):>7} {row['seconds']:>8.1f}")
    peak_mb = int(peak.group(1)) / 1024 if peak else None
    status = "met" if wall <= TARGET_S else "not met"
    print(
        f"wall {wall:.1f} s (target <= {TARGET_S:.0f} s: {status}), peak RSS {peak_mb:.0f} MiB, stages {stages}, "
        f"calibration dtype {', '.join(sorted(dtypes)) or 'none'}"
    )
    record = run_record(
        recipe=str(args.recipe.relative_to(ROOT) if args.recipe.is_relative_to(ROOT) else args.recipe),
        wall_s=round(wall, 2),
        peak_rss_mib=round(peak_mb, 1) if peak_mb else None,
        stages=stages,
        calibration_dtype=sorted(dtypes),
        by_kind={k: {"stages": int(v["stages"]), "seconds": round(v["seconds"], 2)} for k, v in kinds.items()},
        stage_seconds=report["stage_seconds"],
        failed_gates=report["failed_gates"],
    )
    save_record(record, args.record)


if __name__ == "__main__":
    main()
