"""Router simulation: replicas of mixed hardware resolve per key under a 95/5 canary, then 90/10.

    python bench/router_sim.py [--keys 100000] [--connections 4] [--workers 2]

Seeds a fresh embedded registry with two sealed releases (1.4.0 and 1.5.0) of a Llama-3-8B-shaped
model (its config, so resolve sizes replicas): hf-bundle bf16 for h100/h200/mi300x, hf-bundle fp8 for
h100/h200, GGUF Q8_0 and Q4_K_M for cpu, all evals passed. Resolve reads only the files' sizes, so each
artifact is made of 1 GiB and 512 MiB shards of zeros (two blobs, uploaded once) adding up to the real
checkpoint's size to the half GiB (`quant.footprint` for the bundles, bits per weight for GGUF).
1.4.0 is promoted to prod, then prod is split 95/5 with 1.5.0; `kiln serve --workers 2` serves it on
a free loopback port with anonymous reads off (every replica sends a read token for the model).

REPLICAS (each a different pool list, policy and workload; each with --connections keep-alive
HTTP/1.1 connections on one uvloop client process) ask `GET /v1/resolve?...&key=K` for --keys keys:
phase 1 asks every key twice, from two different replicas (so with different hardware and
workloads: the release must depend on the key alone), in a shuffled order; then the weights change to
90/10 (`PUT .../channels/prod/split` with a promote token) and phase 2 asks every key again, twice,
from two different replicas paired otherwise. Targets (the exit status is 1 when one is missed):

- the canary's observed share within 1 % (absolute) of its weight, in both phases (the table also
  gives the binomial 3 sigma for --keys keys: a uniform hash lands within it nearly always);
- no key answered two releases within a phase (the weights were unchanged);
- at 90/10, no key that was on 1.5.0 leaves it: keys only move 1.4.0 -> 1.5.0 (expected: ~5 % of
  them); every answer is a 200 with an ETag.

Request rate and latency (p50/p99, the client on the same 2 cores as the server) are side figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script
from registry_resolve import (  # the model, its evals and the server start of the resolve benchmark
    LLAMA_3_8B,
    bench_eval,
    free_port,
    serving,
)

from kiln.placement.model import parameters

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL, CHANNEL = "router", "prod"
STABLE, CANARY = "1.4.0", "1.5.0"
VERSIONS = (STABLE, CANARY)
WEIGHTS: tuple[dict[str, float], ...] = ({STABLE: 95, CANARY: 5}, {STABLE: 90, CANARY: 10})  # percent
TARGET_SHARE_ERROR = 0.01  # absolute
GIB, SHARD_SIZES = 1024**3, (1024**3, 512 * 1024**2)
CONFIG = LLAMA_3_8B  # the keys resolve's sizing reads
# (target, quant, hardware, KL of 1.4.0's eval); GGUF bits per weight from llama.cpp's quantize table.
ARTIFACTS = [
    ("hf-bundle", "bf16", ["h100", "h200", "mi300x"], 0.0),
    ("hf-bundle", "fp8", ["h100", "h200"], 0.0021),
    ("gguf", "q8_0", ["cpu"], 0.0012),
    ("gguf", "q4_k_m", ["cpu"], 0.0310),
]
GGUF_BITS_PER_WEIGHT = {"q8_0": 8.5, "q4_k_m": 4.89}


@dataclass(frozen=True)
class Replica:
    """A router's replica: the pools it can place in (free devices), its policy and its workload."""

    name: str
    hardware: str
    policy: str
    context: int
    concurrency: int


REPLICAS = [
    Replica("r0", "h100:8", "latency", 8192, 64),
    Replica("r1", "h100:4,mi300x", "cost", 8192, 32),
    Replica("r2", "h200", "latency", 32768, 16),
    Replica("r3", "mi300x:8", "quality", 131072, 8),
    Replica("r4", "cpu", "cost", 4096, 4),
    Replica("r5", "h200:2,h100:4", "latency", 32768, 64),
    Replica("r6", "mi300x,cpu", "cost", 8192, 8),
    Replica("r7", "tpu-v5e,cpu", "latency", 4096, 1),
]


def artifact_bytes(quant: str) -> int:
    """What the artifact's checkpoint weighs for CONFIG, rounded to half a GiB (the smallest shard)."""
    from kiln.core.shape import ShapeRecord
    from kiln.quant.footprint import checkpoint_bytes

    if quant in GGUF_BITS_PER_WEIGHT:
        shape = ShapeRecord.from_untrusted(CONFIG)
        assert isinstance(shape, ShapeRecord)
        size = (parameters(shape) or 0) * GGUF_BITS_PER_WEIGHT[quant] / 8
    else:
        size = checkpoint_bytes(CONFIG, quant)
    return round(size / SHARD_SIZES[1]) * SHARD_SIZES[1]


def seed(data_dir: Path) -> tuple[str, str, dict[str, float]]:
    """Two sealed releases, prod split 95/5; returns a read token and a promote token for the model,
    and each artifact's size in GiB."""
    from kiln.client import RegistryClient
    from kiln.core.manifest import ArtifactManifest, FileEntry

    shards = []
    for size in SHARD_SIZES:  # zeros, sparse on disk; the registry stores each blob once
        path = data_dir.parent / f"shard-{size}"
        with open(path, "wb") as f:
            f.truncate(size)
        shards.append(path)
    sizes: dict[str, float] = {}
    with RegistryClient.connect(data_dir) as client:
        digests = [client.upload_blob(path).sha256 for path in shards]
        client.ensure_model(MODEL, "router simulation")
        for n, version in enumerate(VERSIONS):
            planned = [f"{target}-{quant}" for target, quant, _, _ in ARTIFACTS]
            client.create_release(
                MODEL, version, source_digest=f"{n}" * 64, planned_artifacts=planned, model_config=CONFIG
            )
            for target, quant, hardware, kl in ARTIFACTS:
                total = artifact_bytes(quant)
                sizes[f"{target}-{quant}"] = total / GIB
                parts = [0] * (total // SHARD_SIZES[0]) + ([1] if total % SHARD_SIZES[0] else [])
                ext = "gguf" if target == "gguf" else "safetensors"
                files = [
                    FileEntry(
                        path=f"model-{i + 1:05d}-of-{len(parts):05d}.{ext}", sha256=digests[p], size=SHARD_SIZES[p]
                    )
                    for i, p in enumerate(parts)
                ]
                manifest = ArtifactManifest(
                    name=f"{target}-{quant}",
                    target=target,
                    format="gguf-v3" if target == "gguf" else "safetensors",
                    quant=quant,
                    hardware=hardware,
                    files=files,
                )
                client.publish_artifact(MODEL, version, manifest)
                client.post_eval(
                    MODEL, version, f"{target}-{quant}", bench_eval(kl * (0.9 if version == CANARY else 1.0))
                )
            client.seal_release(MODEL, version)
        client.promote(MODEL, STABLE, CHANNEL)
        client.set_split(MODEL, CHANNEL, WEIGHTS[0], reason="canary")
        read = client.create_token("router-replicas", ["read"], models=[MODEL]).token
        promote = client.create_token("router-rollout", ["promote"], models=[MODEL]).token
    for path in shards:
        path.unlink()
    return read, promote, sizes


def resolve_path(replica: Replica, key: str) -> str:
    query = {
        "model": MODEL,
        "channel": CHANNEL,
        "hardware": replica.hardware,
        "policy": replica.policy,
        "context": replica.context,
        "concurrency": replica.concurrency,
        "key": key,
    }
    return "/v1/resolve?" + urlencode(query, safe=":,")


@dataclass
class Phase:
    """What one phase observed: per key the release code of its first answer, and what went wrong."""

    keys: int
    first: bytearray = field(init=False)
    answers: int = 0
    switched: set[int] = field(default_factory=set)
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    chosen: dict[tuple[str, str], int] = field(default_factory=dict)  # (replica, what it got) -> answers
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        self.first = bytearray(b"\xff" * self.keys)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def canary_share(self) -> float:
        return sum(1 for v in self.first if v == 1) / self.keys


class Connection:
    """One keep-alive HTTP/1.1 connection: what a router's sidecar holds to the registry."""

    def __init__(self, port: int, auth: str) -> None:
        self.port, self.auth = port, auth
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {self.auth}\r\n\r\n".encode())
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.writer.close()
            self.writer = None
        return int(head[0].split()[1]), headers, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def assignments(keys: int, phase: int, seed: int) -> dict[int, list[int]]:
    """Per replica, the keys it asks in `phase`: each key twice, from two different replicas (which
    differ between phases), in a shuffled order."""
    n = len(REPLICAS)
    asked: dict[int, list[int]] = {r: [] for r in range(n)}
    for k in range(keys):
        a = (k + 3 * phase) % n
        b = (a + 1 + (k // n + phase) % (n - 1)) % n  # never a
        asked[a].append(k)
        asked[b].append(k)
    rng = random.Random(seed + phase)
    for ks in asked.values():
        rng.shuffle(ks)
    return asked


async def run_phase(
    port: int, auth: str, keys: list[str], phase: int, connections: int, weights: dict[str, float]
) -> Phase:
    """Every replica asks its keys over its connections, all replicas at once."""
    result = Phase(len(keys))
    expected_split = {v: float(w) for v, w in weights.items()}

    async def replica_worker(replica: Replica, queue: list[int]) -> None:
        conn = Connection(port, auth)
        try:
            while queue:
                k = queue.pop()
                started = time.perf_counter()
                status, headers, body = await conn.get(resolve_path(replica, keys[k]))
                result.latencies.append(time.perf_counter() - started)
                result.answers += 1
                if status != 200:
                    result.error(f"HTTP {status}: {body[:200].decode(errors='replace')}")
                    continue
                if "etag" not in headers:
                    result.error("no ETag")
                answer = json.loads(body)
                version = answer["version"]
                split = {m["version"]: m["weight"] for m in answer["split"] or []}
                if split != expected_split or [m["version"] for m in answer["split"] if m["chosen"]] != [version]:
                    result.error(f"split {answer['split']}")
                code = VERSIONS.index(version)
                if result.first[k] == 0xFF:
                    result.first[k] = code
                elif result.first[k] != code:
                    result.switched.add(k)
                got = f"{answer['artifact']['name']} on {answer['hardware']} TP {answer['reason']['tp']}"
                result.chosen[(replica.name, got)] = result.chosen.get((replica.name, got), 0) + 1
        finally:
            conn.close()

    tasks = []
    started = time.perf_counter()
    for r, queue in assignments(len(keys), phase, seed=7).items():
        # The replica's connections share its queue (pop from the end: no copying).
        tasks += [replica_worker(REPLICAS[r], queue) for _ in range(connections)]
    await asyncio.gather(*tasks)
    result.wall_s = time.perf_counter() - started
    return result


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    import uvloop

    from kiln.client import RegistryClient

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--connections", type=int, default=4, help="keep-alive connections per replica")
    ap.add_argument("--workers", type=int, default=2)
    add_record_argument(ap, "router_sim")
    args = ap.parse_args()

    keys = [f"session-{i:06d}" for i in range(args.keys)]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-router-") as tmp:
        data = Path(tmp) / "registry"
        seed_started = time.perf_counter()
        read_token, promote_token, sizes = seed(data)
        seed_s = time.perf_counter() - seed_started
        port = free_port()
        auth = f"Bearer {read_token}"
        env = {**os.environ, "KILN_REGISTRY_DATA_DIR": str(data), "KILN_REGISTRY_ANONYMOUS_READ": "false"}
        cmd = [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--workers", str(args.workers)]
        url = f"http://127.0.0.1:{port}{resolve_path(REPLICAS[0], 'probe')}"
        with serving(cmd, env, url, f"Authorization: {auth}") as server:
            try:
                phases = [uvloop.run(run_phase(port, auth, keys, 0, args.connections, WEIGHTS[0]))]
                with RegistryClient.connect(f"http://127.0.0.1:{port}", token=promote_token) as rollout:
                    rollout.set_split(MODEL, CHANNEL, WEIGHTS[1], reason="canary to 10 %")
                phases.append(uvloop.run(run_phase(port, auth, keys, 1, args.connections, WEIGHTS[1])))
            finally:
                server.terminate()
                server.wait(timeout=30)

    before, after = phases
    moved_up = sum(1 for a, b in zip(before.first, after.first, strict=True) if a == 0 and b == 1)
    moved_down = sum(1 for a, b in zip(before.first, after.first, strict=True) if a == 1 and b == 0)
    rows: list[dict[str, Any]] = []
    checks: list[tuple[str, bool]] = []
    for n, (phase, weights) in enumerate(zip(phases, WEIGHTS, strict=True)):
        weight = weights[CANARY] / 100
        share = phase.canary_share()
        sigma3 = 3 * math.sqrt(weight * (1 - weight) / args.keys)
        lat = sorted(phase.latencies)
        unanswered = sum(1 for v in phase.first if v == 0xFF)
        rows.append(
            {
                "phase": n + 1,
                "weights": f"{weights[STABLE]}/{weights[CANARY]}",
                "canary_weight": weight,
                "canary_share": share,
                "binomial_3sigma": sigma3,
                "keys_switched": len(phase.switched),
                "keys_unanswered": unanswered,
                "answers": phase.answers,
                "errors": phase.errors,
                "wall_s": phase.wall_s,
                "rps": phase.answers / phase.wall_s,
                "p50_ms": quantile(lat, 0.50) * 1e3,
                "p99_ms": quantile(lat, 0.99) * 1e3,
            }
        )
        checks.append(
            (f"phase {n + 1}: canary share within 1 % of {weight:.0%}", abs(share - weight) <= TARGET_SHARE_ERROR)
        )
        checks.append((f"phase {n + 1}: no key switched release", not phase.switched))
        checks.append(
            (f"phase {n + 1}: every answer a 200 with an ETag, every key answered", not phase.errors and not unanswered)
        )
    checks.append(("90/10: no key left 1.5.0", moved_down == 0))

    print(f"{len(REPLICAS)} replicas x {args.connections} connections, {args.keys:,} keys, each asked twice a phase")
    print(
        f"{'phase':>5} {'weights':>8} {'canary':>8} {'|err|':>7} {'3 sigma':>8} {'switched':>8} "
        f"{'answers':>8} {'errors':>6} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7}"
    )
    for r in rows:
        print(
            f"{r['phase']:>5} {r['weights']:>8} {r['canary_share']:>8.3%} "
            f"{abs(r['canary_share'] - r['canary_weight']):>7.3%} "
            f"{r['binomial_3sigma']:>8.3%} {r['keys_switched']:>8} {r['answers']:>8} {sum(r['errors'].values()):>6} "
            f"{r['rps']:>7.0f} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f}"
        )
    print(
        f"95/5 -> 90/10: {moved_up:,} keys moved 1.4.0 -> 1.5.0 ({moved_up / args.keys:.3%}; expected ~5 %), "
        f"{moved_down} moved 1.5.0 -> 1.4.0"
    )
    print(f"\n{'replica':>7} {'pools':>15} {'policy':>8} {'context x conc.':>16}  answer (phase 1)")
    answers_by_replica: dict[str, list[str]] = {}
    for (name, got), count in sorted(before.chosen.items()):
        answers_by_replica.setdefault(name, []).append(f"{got} ({count})")
    for rep in REPLICAS:
        print(
            f"{rep.name:>7} {rep.hardware:>15} {rep.policy:>8} {f'{rep.context} x {rep.concurrency}':>16}  "
            + "; ".join(answers_by_replica.get(rep.name, ["-"]))
        )
    for phase in phases:
        for what, count in phase.errors.items():
            print(f"error x{count}: {what}")
    print()
    for what, ok in checks:
        print(f"{'met   ' if ok else 'MISSED'} {what}")

    record = run_record(
        keys=args.keys,
        replicas=[rep.__dict__ for rep in REPLICAS],
        connections_per_replica=args.connections,
        workers=args.workers,
        artifact_gib=sizes,
        seed_s=seed_s,
        phases=rows,
        moved_to_canary=moved_up,
        moved_from_canary=moved_down,
        answers_by_replica=answers_by_replica,
        checks={what: ok for what, ok in checks},
    )
    save_record(record, args.record)
    if not all(ok for _, ok in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
