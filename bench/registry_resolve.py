"""Benchmark: `GET /v1/resolve` throughput and latency at 64 connections, through a real server.

    python bench/registry_resolve.py [--workers 2] [--connections 64] [--seconds 10]

Publishes a release with seven artifacts (small random blobs; resolve never reads blob bytes) into
a fresh embedded registry, promotes it to prod, serves it with `kiln serve` (uvicorn, uvloop,
httptools) on a free loopback port, and drives it with wrk (Debian package `wrk`). Prints a table
and appends a JSON record to bench/results/registry_resolve.jsonl.

Peers (DESIGN.md, same machine kind): MLflow alias lookup ~140 req/s (p99 ~900 ms); FastAPI+uvicorn
returning fixed JSON ~4,400 req/s. Target: >= 2,000 req/s with p99 <= 60 ms at 64 connections.
Note that wrk shares the 2 cores with the server.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET_RPS, TARGET_P99_MS = 2000.0, 60.0


def seed(data_dir: Path) -> None:
    from kiln.manifest import ArtifactManifest, FileEntry
    from registry.client import RegistryClient

    with RegistryClient.connect(data_dir) as client:
        client.ensure_model("bench", "resolve benchmark")
        config = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}
        client.create_release("bench", "1.0.0", source_digest="0" * 64, model_config=config)
        for i, (target, quant, hw) in enumerate(
            [("gguf", q, ["cpu", "apple-m2", "edge"]) for q in ("f16", "q8_0", "q6_k", "q4_k_m", "q4_0")]
            + [("hf-bundle", "bf16", ["cpu", "a100", "h100", "h200", "mi300x"]), ("hf-bundle", "fp8", ["h100"])]
        ):
            blob = tmp_blob(data_dir, i)
            digest = hashlib.sha256(blob.read_bytes()).hexdigest()
            client.upload_blob(blob, digest)
            client.publish_artifact(
                "bench",
                "1.0.0",
                ArtifactManifest(
                    name=f"{target}-{quant}",
                    target=target,
                    format="gguf-v3" if target == "gguf" else "safetensors",
                    quant=quant,
                    hardware=hw,
                    files=[FileEntry(path="model.bin", sha256=digest, size=blob.stat().st_size)],
                ),
            )
            client.post_eval(
                "bench", "1.0.0", f"{target}-{quant}", runtime="bench", status="passed", metrics={"kl": 0.001 * i}
            )
        client.promote("bench", "1.0.0", "prod")


def tmp_blob(data_dir: Path, i: int) -> Path:
    path = data_dir.parent / f"blob-{i}"
    path.write_bytes(os.urandom(4096 + i))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_wrk(out: str) -> dict[str, float]:
    def ms(value: str, unit: str) -> float:
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    lat = {p: ms(v, u) for p, v, u in re.findall(r"\s(50|99)%\s+([\d.]+)(us|ms|s)", out)}
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50_ms": lat["50"], "p99_ms": lat["99"], "non_2xx": float(errors.group(1)) if errors else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=10)
    add_record_argument(ap, "registry_resolve")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "registry"
        seed(data)
        port = free_port()
        env = {**os.environ, "KILN_REGISTRY_DATA_DIR": str(data)}
        cmd = [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers", str(args.workers)]
        with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as server:
            try:
                url = f"http://127.0.0.1:{port}/v1/resolve?model=bench&hardware=cpu&channel=prod"
                for _ in range(100):
                    if subprocess.run(["curl", "-sf", url], capture_output=True).returncode == 0:
                        break
                    time.sleep(0.2)
                subprocess.run(["wrk", "-t2", "-c", str(args.connections), "-d2s", url], capture_output=True)  # warm
                out = subprocess.run(
                    ["wrk", "-t2", "-c", str(args.connections), f"-d{args.seconds}s", "--latency", url],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            finally:
                server.terminate()
                server.wait(timeout=30)
    result = parse_wrk(out)
    print(f"{'workers':>8} {'conns':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'non-2xx':>8}  target")
    print(
        f"{args.workers:>8} {args.connections:>6} {result['rps']:>8.0f} {result['p50_ms']:>8.1f} "
        f"{result['p99_ms']:>8.1f} {result['non_2xx']:>8.0f}  >= {TARGET_RPS:.0f} req/s, p99 <= {TARGET_P99_MS:.0f} ms"
    )
    save_record(run_record(workers=args.workers, connections=args.connections, **result), args.record)


if __name__ == "__main__":
    main()
