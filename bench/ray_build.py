"""Benchmark: the example's full build with the local executor and with the Ray executor, side by side.

    python bench/ray_build.py [--recipe examples/tiny-llama/kiln.yaml]

Three builds of the same recipe, each in a fresh process into an empty work directory, one after the
other on this machine:

1. `kiln build` with the local executor (every stage in one process, one at a time);
2. `kiln build --executor ray` on a local Ray cluster the build starts (one node, this machine's cores);
3. `kiln build --executor ray --store s3://...` on a cluster of 2 single-CPU nodes bound to loopback
   (`ray start`, as the tests start theirs), exchanging stages through an S3 server (moto's, a local
   process): what a fleet does, on one machine.

Each build's outputs are then compared: every stage's key and digest (its files and record) must be
the same in all three. The table gives wall times (cluster start-up excluded, Ray's own start-up for
a local cluster included) and the ratio to the local executor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(recipe: Path, work: Path, env: dict[str, str], *extra: str) -> tuple[float, dict[str, Any]]:
    cmd = [sys.executable, "-m", "kiln", "build", str(recipe), "--work-dir", str(work), "--json", *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd[3:])} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall, json.loads(done.stdout)


def local_outputs(work: Path) -> dict[str, tuple[str, str]]:
    """{node: (key, digest)} of every stage.json under a work directory (each Ray node's copy included)."""
    from kiln.core.digest import sha256_json

    found: dict[str, tuple[str, str]] = {}
    for meta_path in work.rglob("stage.json"):
        meta = json.loads(meta_path.read_text())
        found[meta["node"]] = (meta["key"], sha256_json({"files": meta["files"], "result": meta["result"]}))
    return found


def bucket_outputs(s3: Any, url: str) -> dict[str, tuple[str, str]]:
    from kiln.core.digest import sha256_json

    found: dict[str, tuple[str, str]] = {}
    for key in s3.leftovers(url):
        if key.endswith("stage.json"):
            meta = json.loads(s3.client.get_object(Bucket="kiln-test", Key=key)["Body"].read())
            found[meta["node"]] = (meta["key"], sha256_json({"files": meta["files"], "result": meta["result"]}))
    return found


def main() -> None:
    from tests.pipeline.ray_cluster import running_ray_cluster
    from tests.registry.s3_server import TEST_ENV, running_s3_server

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "examples/tiny-llama/kiln.yaml")
    add_record_argument(ap, "ray_build")
    args = ap.parse_args()
    os.environ.update(TEST_ENV)  # the local S3 server's credentials, never a developer's
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "RAY_USAGE_STATS_ENABLED": "0"}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ray-") as tmp:
        root = Path(tmp)
        wall, report = build(args.recipe, root / "local", env)
        rows["local executor"] = {"wall_s": wall, "stages": report["stages"]}
        local = local_outputs(root / "local")

        wall, report = build(args.recipe, root / "ray", env, "--executor", "ray")
        rows["ray, local cluster (1 node, 2 CPUs)"] = {"wall_s": wall, "stages": report["stages"]}
        on_ray = local_outputs(root / "ray")

        with running_s3_server(root / "moto.log") as s3, running_ray_cluster(s3, head={}, worker={}) as cluster:
            url = s3.new_url()
            wall, report = build(
                args.recipe,
                root / "cluster",
                cluster.env,
                "--executor",
                "ray",
                "--ray-address",
                cluster.address,
                "--store",
                url,
            )
            rows["ray, 2 nodes x 1 CPU, S3 store"] = {"wall_s": wall, "stages": report["stages"]}
            in_bucket = bucket_outputs(s3, url)
    same = local == on_ray == in_bucket
    base = rows["local executor"]["wall_s"]
    print(f"{'executor':>34} {'wall s':>8} {'x local':>8}  stages")
    for name, row in rows.items():
        row["ratio"] = row["wall_s"] / base
        print(f"{name:>34} {row['wall_s']:>8.1f} {row['ratio']:>8.2f}  {row['stages']}")
    print(f"every stage's key and digest the same in all three builds ({len(local)} stages): {same}")
    save_record(run_record(builds=rows, stages_compared=len(local), identical=same), args.record)
    if not same:
        sys.exit("the builds differ")


if __name__ == "__main__":
    main()
