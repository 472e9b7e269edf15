"""`kiln hardware probe` on this machine's CPU: a sane record within a minute, published only by an unlimited admin.

The probe runs once for the module (a real measurement, `--device cpu --json`); the publishing tests send that
run (`--from`) to a registry served on loopback, each with a token of another kind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.core.hardware import FRACTION, builtin_catalog, parse_profile
from tests.registry.conftest import make_token
from tests.registry.helpers import LLAMA_CONFIG, make_release, post_eval, promote, publish, seal, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
PROBE_LIMIT_S = 60


def kiln(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KILN_TOKEN"}
    if token is not None:
        env["KILN_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path, float]]:
    """The probe's --json output on this machine's CPU, the file it is saved in, and the seconds it took in all."""
    started = time.monotonic()
    out = kiln("hardware", "probe", "--device", "cpu", "--json")
    seconds = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    saved = tmp_path_factory.mktemp("probe") / "probe.json"
    saved.write_text(out.stdout)
    yield json.loads(out.stdout), saved, seconds


def test_the_probe_measures_this_cpu_within_a_minute(probed: tuple[dict[str, Any], Path, float]) -> None:
    doc, _, seconds = probed
    assert seconds < PROBE_LIMIT_S, f"the probe took {seconds:.1f} s"
    run = doc["run"]
    assert doc["hardware"] == "cpu" and run["device"] == "cpu" and doc["problems"] == []
    assert run["seconds"] < seconds and run["measured_on"] == datetime.now(UTC).date().isoformat()
    cpu = builtin_catalog().get("cpu")
    readings = {r["key"]: r for r in doc["readings"]}
    assert {"memory_read", "decode.bf16", "matmul.bf16", "matmul_small_m.bf16"} <= set(readings)
    assert "matmul.fp8" in run["skipped"]  # no FP8 units on the CPU entry
    for key, r in readings.items():
        peak = cpu.bandwidth_gbs if r["unit"] == "GB/s" else getattr(cpu.tflops, key.split(".")[1])
        assert r["peak"] == peak and r["fraction"] == float(f"{r['median'] / peak:.4g}"), r
        assert 0 < r["median"] <= r["best"] and r["repeats"] >= 3, r
    # Physically plausible for a CPU socket: GB/s of memory reads, a fraction of a TFLOP/s of bf16 matmuls.
    assert 0.5 < readings["memory_read"]["median"] < 1000
    assert 0.001 < readings["matmul.bf16"]["median"] < 100

    measured = doc["measured"]
    assert measured["memory_read"] == readings["memory_read"]["fraction"]
    assert measured["decode"]["bf16"] == readings["decode.bf16"]["fraction"]
    assert measured["matmul"]["bf16"] == readings["matmul.bf16"]["fraction"]
    assert measured["matmul_small_m"]["bf16"] == readings["matmul_small_m.bf16"]["fraction"]
    assert all(FRACTION[0] <= v <= FRACTION[1] for kind in ("decode", "matmul") for v in measured[kind].values() if v)
    mem_available = next(
        int(line.split()[1]) / 2**20
        for line in Path("/proc/meminfo").read_text().splitlines()
        if "MemAvailable" in line
    )
    assert 1 <= measured["allocatable_gib"] <= 1.5 * mem_available
    assert measured["source"].startswith(f"kiln hardware probe on {run['device_name']} (torch ")
    # The record is a valid catalog entry's `measured`.
    entry = parse_profile({**cpu.model_dump(mode="json"), "measured": measured})
    assert entry.measured is not None and entry.measured.model_dump(mode="json") == measured


def test_the_probe_prints_a_table_for_people(probed: tuple[dict[str, Any], Path, float]) -> None:
    _, saved, _ = probed
    out = kiln("hardware", "probe", "--from", str(saved))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(json.loads(saved.read_text())["run"]["device_name"]) and " as cpu: " in lines[0]
    assert any(line.startswith("memory_read") and "GB/s" in line for line in lines)
    assert any(line.startswith("matmul.fp8") and "not measured" in line for line in lines)


def _seed(client: TestClient) -> None:
    make_release(client, planned=["gguf-q8"], model_config=LLAMA_CONFIG)
    publish(client, "gguf-q8", {"model.gguf": b"q8" * 64}, ["cpu"])
    assert post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.001}).status_code in (200, 201)
    seal(client)
    assert promote(client).status_code == 200


def test_an_admin_publishes_the_run_and_resolve_uses_it(
    app: FastAPI, client: TestClient, probed: tuple[dict[str, Any], Path, float]
) -> None:
    doc, saved, _ = probed
    _seed(client)
    before = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}).json()["reason"]
    assert before["basis"]["decode"] == "spec"
    token = make_token(app, ["admin"], name="probe-admin")
    with serve_in_thread(app) as port:
        out = kiln("hardware", "probe", "--from", str(saved), "--publish", "--registry", f"http://127.0.0.1:{port}",
                   "--json", token=token)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["published"] == "registry (overrides builtin)"
    cpu = client.get("/v1/hardware/cpu").json()
    assert cpu["measured"] == doc["measured"] and cpu["source"] == "registry (overrides builtin)"
    assert {k: v for k, v in cpu.items() if k not in ("measured", "source")} == {
        k: v for k, v in builtin_catalog().get("cpu").model_dump(mode="json").items() if k != "measured"
    }
    audit = next(e for e in client.get("/v1/audit").json() if e["action"] == "hardware.put")
    assert audit["actor"] == "token:probe-admin" and audit["details"]["after"]["measured"] == doc["measured"]

    # GGUF's weights are dequantized in llama.cpp's kernels: read at the measured memory-read share.
    after = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}).json()["reason"]
    basis = after["basis"]
    assert (basis["decode"], basis["bandwidth_path"]) == ("measured", "memory_read")
    assert basis["bandwidth_fraction"] == doc["measured"]["memory_read"]
    assert basis["source"] == f"{doc['measured']['source']}, {doc['measured']['measured_on']}"
    # Bandwidth-bound (the config states no intermediate size, so no FLOP count): weights and KV cache alike
    # read at that share of the catalog's 50 GB/s.
    share = doc["measured"]["memory_read"]
    assert after["decode_tokens_per_s_bound"] == pytest.approx(before["decode_tokens_per_s_bound"] * share)
    assert f"decode at {share:.2f} × 50 GB/s (memory read, measured)" in after["explanation"]


def test_only_an_unlimited_admin_publishes(
    app: FastAPI, client: TestClient, probed: tuple[dict[str, Any], Path, float]
) -> None:
    _, saved, _ = probed
    callers = {
        "anonymous": (None, "UNAUTHORIZED"),
        "read": (make_token(app, ["read"], name="reader"), "FORBIDDEN"),
        "publish": (make_token(app, ["publish"], name="publisher"), "FORBIDDEN"),
        "scoped admin": (make_token(app, ["admin"], ["other-*"], name="other-admin"), "FORBIDDEN"),
    }
    with serve_in_thread(app) as port:
        for who, (token, code) in callers.items():
            out = kiln("hardware", "probe", "--from", str(saved), "--publish", "--registry", f"http://127.0.0.1:{port}",
                       token=token)  # fmt: skip
            assert out.returncode == 6 and code in out.stderr, (who, out.returncode, out.stderr)
    assert client.get("/v1/hardware/cpu").json() == {**builtin_catalog().get("cpu").model_dump(mode="json"),
                                                     "source": "builtin"}  # fmt: skip
    assert not [e for e in client.get("/v1/audit").json() if e["action"].startswith("hardware.")]


def test_a_saved_run_that_is_not_one_is_refused_naming_its_fields(tmp_path: Path) -> None:
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({"run": {"device": "cpu", "readings": [{"key": "memory_write"}]}}))
    out = kiln("hardware", "probe", "--from", str(bad))
    text = " ".join(out.stderr.split())  # the error console wraps long lines
    assert out.returncode == 2 and "INVALID_INPUT" in text, out.stderr
    assert "not a probe run" in text and "device_name: Field required" in text
    assert "readings.0.key: String should match pattern" in text
