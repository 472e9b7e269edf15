"""Benchmark: load and soak, 64 clients of every kind against a real registry server, then a consistency check.

    python bench/soak.py [--db sqlite,postgres] [--seconds 300] [--clients 64] [--workers 2]

For each database (SQLite embedded; PostgreSQL: a fresh database on `--postgres`, dropped after), a fresh
registry is seeded (model `soak`, release 1.0 sealed on prod) and served by `python -m kiln.registry.server`
(uvicorn, uvloop, httptools, its access log on) on a free loopback port. `--clients` asyncio clients
(httpx, one process) then loop for `--seconds`, each request drawn from this mix:

    publish (open a release, upload a random blob, attach the artifact, its eval, seal), promote to
    staging, split prod between 1.0 and a published release, PUT a hardware entry (each client its own
    SKU), resolve (anonymous, a key per request), download a sealed blob (sha256 checked), an OCI pull
    (manifest, then its layer, digest checked), listings (releases, hardware, models, a channel)

while one more client, in a process of its own, asks `/healthz` every 50 ms. The clients share the machine's cores
with the server: they run at `--client-nice` (10), so the cores go first to the server and its database, as they
would with the clients on other machines; the prober runs at the server's priority. Recorded: requests served,
5xx (must be 0) and transport errors, `/healthz` p99 (target <= 100 ms), resolve p99, per kind p50/p99. Then the check:
every acknowledged publish is a sealed release whose artifact's blob downloads sha256-exact, every
acknowledged promotion is in the channel's history, every client's SKU holds its last acknowledged
write, and no release is left half-made (open, with a published artifact). Not a timed test: CI does
not run it. The machine's load average at the start and end is in the record (2 shared cores).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = "soak"
TARGET_HEALTHZ_P99_MS = 100.0
LLAMA_CONFIG: dict[str, Any] = {  # a small Llama: resolve sizes replicas from these keys
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
METRICS = {
    "tokens": 255, "windows": 1, "vocab_size": 512, "ppl_ref": 10.0, "ppl": 10.01, "ppl_change": 0.001,
    "kl": 0.001, "kl_error": 0.0, "kl_max": 0.02, "top1": 0.99, "greedy_tokens": 32, "greedy_match": None,
    "greedy_match_total": None,
}  # fmt: skip
# kind -> weight in the mix
MIX = {
    "publish": 6,
    "promote": 3,
    "split": 2,
    "hardware": 8,
    "resolve": 40,
    "download": 12,
    "oci_pull": 8,
    "listing": 21,
}


@dataclass
class Ledger:
    """What the server acknowledged, and every request's kind, status and latency."""

    published: dict[str, tuple[str, int]] = field(default_factory=dict)  # version -> (sha256, size)
    promoted: set[str] = field(default_factory=set)
    hardware: dict[str, int] = field(default_factory=dict)  # SKU -> its last acknowledged memory_gib
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    server_errors: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)
    digest_mismatches: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def call(
    ledger: Ledger, client: httpx.AsyncClient, kind: str, method: str, url: str, **kwargs: Any
) -> httpx.Response | None:
    started = time.perf_counter()
    try:
        response = await client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        ledger.transport_errors.append(f"{kind} {method} {url}: {type(exc).__name__}")
        return None
    ledger.latencies[kind].append(time.perf_counter() - started)
    ledger.statuses[f"{response.status_code // 100}xx"] += 1
    if response.status_code >= 500:
        ledger.server_errors.append(f"{kind} {method} {url}: {response.status_code} {response.text[:200]}")
    return response


async def publish(ledger: Ledger, c: httpx.AsyncClient, version: str, rng: random.Random) -> None:
    """Open `version`, upload its one blob, attach the artifact and its eval, seal: acknowledged when sealed."""
    r = await call(
        ledger,
        c,
        "publish",
        "POST",
        f"/v1/models/{MODEL}/releases",
        json={
            "version": version,
            "source_digest": "0" * 64,
            "planned_artifacts": ["gguf-q8"],
            "lineage": {"source": "soak"},
            "model_config": LLAMA_CONFIG,
        },
    )
    if r is None or r.status_code not in (200, 201):
        return
    data = rng.randbytes(rng.randint(16 << 10, 512 << 10))
    digest = hashlib.sha256(data).hexdigest()
    r = await call(ledger, c, "publish", "PUT", f"/v1/blobs/{digest}", content=data)
    if r is None or r.status_code not in (200, 201):
        return
    manifest = {
        "name": "gguf-q8",
        "target": "gguf",
        "format": "gguf-v3",
        "quant": "q8_0",
        "hardware": ["cpu", "h100"],
        "files": [{"path": "model.gguf", "sha256": digest, "size": len(data)}],
    }
    base = f"/v1/models/{MODEL}/releases/{version}"
    r = await call(ledger, c, "publish", "POST", f"{base}/artifacts", json=manifest)
    if r is None or r.status_code not in (200, 201):
        return
    body = {"runtime": "llama.cpp", "status": "passed", "metrics": METRICS}
    r = await call(ledger, c, "publish", "POST", f"{base}/artifacts/gguf-q8/evals", json=body)
    if r is None or r.status_code not in (200, 201):
        return
    r = await call(ledger, c, "publish", "POST", f"{base}/seal")
    if r is not None and r.status_code in (200, 201):
        ledger.published[version] = (digest, len(data))


async def client_loop(
    ledger: Ledger, base: str, admin: str, index: int, deadline: float, gguf_layer: tuple[str, str]
) -> None:
    rng = random.Random(index)
    kinds, weights = list(MIX), list(MIX.values())
    headers = {"Authorization": f"Bearer {admin}"}
    sku = f"soak-node-{index}"
    n = 0
    # Idle connections dropped after 2 s, before the server's 5 s keep-alive: no request is sent on a
    # connection the server is closing.
    limits = httpx.Limits(keepalive_expiry=2)
    async with (
        httpx.AsyncClient(base_url=base, headers=headers, timeout=120, limits=limits) as c,
        httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as anonymous,
    ):
        entry = (await c.get("/v1/hardware/h100")).json()
        entry = {k: v for k, v in entry.items() if k not in ("name", "source")}
        while time.monotonic() < deadline:
            n += 1
            kind = rng.choices(kinds, weights)[0]
            sealed = list(ledger.published)
            if kind == "publish":
                await publish(ledger, c, f"2.{index}.{n}", rng)
            elif kind == "promote" and sealed:
                version = rng.choice(sealed)
                r = await call(
                    ledger, c, kind, "POST", f"/v1/models/{MODEL}/channels/staging", json={"version": version}
                )
                if r is not None and r.status_code == 200:
                    ledger.promoted.add(version)
            elif kind == "split" and sealed:
                weights_body = [{"version": "1.0", "weight": 90}, {"version": rng.choice(sealed), "weight": 10}]
                body = {"weights": weights_body, "reason": "soak"}
                await call(ledger, c, kind, "POST", f"/v1/models/{MODEL}/channels/prod/split", json=body)
            elif kind == "hardware":
                memory = 80 + n
                r = await call(ledger, c, kind, "PUT", f"/v1/hardware/{sku}", json={**entry, "memory_gib": memory})
                if r is not None and r.status_code == 200:
                    ledger.hardware[sku] = memory
            elif kind == "resolve":
                params = {"model": MODEL, "hardware": rng.choice(["h100", "cpu", "h100,cpu"]), "key": f"k{n}"}
                await call(ledger, anonymous, kind, "GET", "/v1/resolve", params=params)
            elif kind == "download" and sealed:
                digest, _ = ledger.published[rng.choice(sealed)]
                r = await call(ledger, anonymous, kind, "GET", f"/v1/blobs/{digest}")
                if r is not None and r.status_code == 200 and hashlib.sha256(r.content).hexdigest() != digest:
                    ledger.digest_mismatches.append(f"blob {digest}")
            elif kind == "oci_pull":
                tag, layer = gguf_layer
                r = await call(ledger, anonymous, kind, "GET", f"/v2/{MODEL}/manifests/{tag}")
                if r is not None and r.status_code == 200:
                    r = await call(ledger, anonymous, kind, "GET", f"/v2/{MODEL}/blobs/{layer}")
                    if (
                        r is not None
                        and r.status_code == 200
                        and "sha256:" + hashlib.sha256(r.content).hexdigest() != layer
                    ):
                        ledger.digest_mismatches.append(f"layer {layer}")
            elif kind == "listing":
                url = rng.choice(
                    [f"/v1/models/{MODEL}/releases", "/v1/hardware", "/v1/models", f"/v1/models/{MODEL}/channels/prod"]
                )
                await call(ledger, anonymous, kind, "GET", url)


def poll_healthz(base: str, seconds: float, out: Any) -> None:
    """`/healthz` every 50 ms for `seconds`, from a process of its own (the clients' own event loop, busy
    hashing and generating blobs, must not count as the server's latency): sends (latencies, errors)."""
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=120) as c:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                status = c.get("/healthz").status_code
                latencies.append(time.perf_counter() - started)
                if status != 200:
                    errors.append(f"healthz {status}")
            except httpx.HTTPError as exc:
                errors.append(f"healthz: {type(exc).__name__}")
            time.sleep(0.05)
    out.send((latencies, errors))


async def check(ledger: Ledger, base: str, admin: str) -> dict[str, Any]:
    """Nothing lost or half-made: what was acknowledged is there, every sealed blob sha256-exact."""
    problems: list[str] = []
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {admin}"}, timeout=120) as c:
        for version, (digest, size) in ledger.published.items():
            release = (await c.get(f"/v1/models/{MODEL}/releases/{version}")).json()
            if release.get("status") != "sealed":
                problems.append(f"{version}: acknowledged sealed, is {release.get('status')}")
            blob = await c.get(f"/v1/blobs/{digest}")
            if (
                blob.status_code != 200
                or len(blob.content) != size
                or hashlib.sha256(blob.content).hexdigest() != digest
            ):
                problems.append(f"{version}: blob {digest} not sha256-exact ({blob.status_code})")
        history: list[dict[str, Any]] = []  # every page of it, newest first
        url: str | None = f"/v1/models/{MODEL}/channels/staging?limit=1000"
        while url:
            r = await c.get(url)
            history += r.json().get("history", [])
            url = r.links.get("next", {}).get("url")
        moved_to = {e.get("to_version") for e in history}
        problems += [f"promotion of {v} to staging not in its history" for v in ledger.promoted - moved_to]
        for sku, memory in ledger.hardware.items():
            got = (await c.get(f"/v1/hardware/{sku}")).json().get("memory_gib")
            if got != memory:
                problems.append(f"{sku}: last acknowledged memory_gib {memory}, holds {got}")
        releases: list[dict[str, Any]] = []
        url = f"/v1/models/{MODEL}/releases?limit=500"
        while url:
            r = await c.get(url)
            page = r.json()
            releases += page if isinstance(page, list) else page.get("items", [])
            url = r.links.get("next", {}).get("url")
        half_made = [r["version"] for r in releases if r.get("status") != "sealed" and r["version"] in ledger.published]
        problems += [f"{v}: acknowledged but not sealed" for v in half_made]
    return {
        "published": len(ledger.published),
        "promoted": len(ledger.promoted),
        "hardware_skus": len(ledger.hardware),
        "releases_listed": len(releases),
        "history_listed": len(history),
        "digest_mismatches": ledger.digest_mismatches,
        "problems": problems,
    }


def seed(base: str, admin: str) -> tuple[str, str]:
    """Release 1.0 sealed on prod; the OCI tag of its artifact and its layer's digest."""
    rng = random.Random(0)
    ledger = Ledger()

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {admin}"}, timeout=120) as c:
            assert (await c.post("/v1/models", json={"name": MODEL})).status_code in (200, 201)
            await publish(ledger, c, "1.0", rng)
            assert "1.0" in ledger.published, ledger.server_errors
            assert (await c.post(f"/v1/models/{MODEL}/channels/prod", json={"version": "1.0"})).status_code == 200

    asyncio.run(run())
    return "1.0-gguf-q8", "sha256:" + ledger.published["1.0"][0]


def admin_token(settings: Any) -> str:
    from kiln.registry.app import open_storage
    from kiln.registry.auth.principal import LOCAL
    from kiln.registry.auth.service import create_token

    storage = open_storage(settings)
    try:
        with storage.sessions()() as session:
            _, secret = create_token(session, "soak-admin", ["admin"], [], LOCAL)
            session.commit()
    finally:
        storage.engine.dispose()
    return secret


def run_one(db: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from kiln.registry.migrate import upgrade
    from kiln.registry.settings import RegistrySettings

    data = tmp / db
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILN_REGISTRY_DATA_DIR": str(data)}
    env["KILN_REGISTRY_BLOB_URL"] = (tmp / f"{db}-blobs").as_uri()
    dropped = None
    if db == "postgres":
        name = f"kiln_soak_{uuid.uuid4().hex[:10]}"
        admin_engine = create_engine(args.postgres, isolation_level="AUTOCOMMIT")
        with admin_engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = make_url(args.postgres).set(database=name).render_as_string(hide_password=False)
        upgrade(url)
        env["KILN_REGISTRY_DATABASE_URL"] = url
        dropped = (admin_engine, name)
    settings = RegistrySettings(
        data_dir=data, database_url=env.get("KILN_REGISTRY_DATABASE_URL"), blob_url=env["KILN_REGISTRY_BLOB_URL"]
    )
    token = admin_token(settings)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp / f"{db}-server.log", "wb")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "kiln.registry.server", "--port", str(port), "--workers", str(args.workers)]
    cmd += ["--log-level", "warning"]
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the registry server did not start; its log: {tmp / f'{db}-server.log'}")
            time.sleep(0.2)
        tag, layer = seed(base, token)
        ledger = Ledger()
        load_start = os.getloadavg()[0]

        async def load() -> float:
            deadline = time.monotonic() + args.seconds
            started = time.monotonic()
            await asyncio.gather(
                *(client_loop(ledger, base, token, i, deadline, (tag, layer)) for i in range(args.clients))
            )
            return time.monotonic() - started

        receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        prober = multiprocessing.get_context("spawn").Process(target=poll_healthz, args=(base, args.seconds, send))
        prober.start()  # at the server's priority: it measures what a caller elsewhere would see
        niceness = os.nice(0)
        os.nice(args.client_nice)
        try:
            elapsed = asyncio.run(load())
        finally:
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
        healthz, healthz_errors = receive.recv()
        prober.join()
        ledger.latencies["healthz"] = healthz
        ledger.statuses["2xx"] += len(healthz) - len(healthz_errors)
        ledger.transport_errors += healthz_errors
        load_end = os.getloadavg()[0]
        consistency = asyncio.run(check(ledger, base, token))
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
        if dropped is not None:
            engine, name = dropped
            with engine.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            engine.dispose()
    kinds = {
        kind: {
            "requests": len(values),
            "p50_ms": round(percentile(values, 0.5) * 1000, 1),
            "p99_ms": round(percentile(values, 0.99) * 1000, 1),
        }
        for kind, values in sorted(ledger.latencies.items())
    }
    served = sum(len(v) for v in ledger.latencies.values())
    return {
        "db": db,
        "seconds": round(elapsed, 1),
        "clients": args.clients,
        "workers": args.workers,
        "client_nice": args.client_nice,
        "requests": served,
        "requests_per_s": round(served / elapsed, 1),
        "statuses": dict(ledger.statuses),
        "server_errors": len(ledger.server_errors),
        "server_error_samples": ledger.server_errors[:10],
        "transport_errors": len(ledger.transport_errors),
        "transport_error_samples": ledger.transport_errors[:10],
        "healthz_p99_ms": kinds.get("healthz", {}).get("p99_ms"),
        "resolve_p99_ms": kinds.get("resolve", {}).get("p99_ms"),
        "kinds": kinds,
        "consistency": consistency,
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": load_end,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    ap.add_argument("--seconds", type=float, default=300.0, help="load per database (default 5 minutes)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2, help="server worker processes (as `kiln serve`)")
    ap.add_argument(
        "--client-nice",
        type=int,
        default=10,
        help="the clients' niceness while they load (default 10): they share the server's cores, and yield them to "
        "the server and its database, as clients on other machines would; 0 to compete",
    )
    ap.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    add_record_argument(ap, "soak")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="kiln-soak-") as tmp:
        for db in args.db.split(","):
            result = run_one(db.strip(), args, Path(tmp))
            runs.append(result)
            if result["server_errors"] or result["consistency"]["problems"]:
                shutil.copy(Path(tmp) / f"{db}-server.log", Path.cwd() / f"soak-{db}-server.log")
    print(
        f"{'db':>9} {'s':>5} {'requests':>9} {'req/s':>7} {'5xx':>4} {'net err':>7} "
        f"{'healthz p99':>11} {'resolve p99':>11} {'published':>9} {'problems':>8}"
    )
    for r in runs:
        print(
            f"{r['db']:>9} {r['seconds']:>5.0f} {r['requests']:>9,} {r['requests_per_s']:>7.0f} "
            f"{r['server_errors']:>4} {r['transport_errors']:>7} {r['healthz_p99_ms']:>9.1f}ms "
            f"{r['resolve_p99_ms']:>9.1f}ms {r['consistency']['published']:>9} {len(r['consistency']['problems']):>8}"
        )
    print(f"{'kind':>9} " + " ".join(f"{r['db']:>24}" for r in runs) + "   (requests, p50/p99 ms)")
    for kind in MIX | {"healthz": 0}:
        cells = []
        for r in runs:
            k = r["kinds"].get(kind, {"requests": 0, "p50_ms": float("nan"), "p99_ms": float("nan")})
            cells.append(f"{k['requests']:>8,} {k['p50_ms']:>7.1f}/{k['p99_ms']:<7.1f}")
        print(f"{kind:>9} " + " ".join(f"{c:>24}" for c in cells))
    met = all(
        r["server_errors"] == 0
        and not r["consistency"]["problems"]
        and not r["consistency"]["digest_mismatches"]
        and (r["healthz_p99_ms"] or 1e9) <= TARGET_HEALTHZ_P99_MS
        for r in runs
    )
    print(
        f"targets (0 5xx, nothing lost, /healthz p99 <= {TARGET_HEALTHZ_P99_MS:.0f} ms): {'met' if met else 'MISSED'}"
    )
    save_record(run_record(runs=runs, targets_met=met), args.record)


if __name__ == "__main__":
    main()
