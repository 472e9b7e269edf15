"""Bounds from measured shares of the peaks: H200's catalog entry carries them, H100's does not.

The H200 figures are recomputed here by hand from one run's measurements on an H200 (PyTorch 2.11, CUDA 13,
CUDA events after warm-up), written out below; the catalog keeps the midpoint of each measured range over its
peak, to four decimals. Llama-3-70B (examples/llama-3-70b) at 32K context, one sequence:

    bf16 (141.1 GB)  TP 2  decode 44.87 tokens/s (53.74 at the peaks)  TTFT 4.76 s (3.59)
    fp8  (72.7 GB)   TP 1  decode 26.74 tokens/s (57.55)               TTFT 4.62 s (3.05)

FP8's decode bound falls below bf16's: its weights were read through `torch._scaled_mm` at M=1 at 0.43 of
the bandwidth, bf16's at 0.83.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.core.hardware import PROFILES, builtin_catalog
from kiln.core.shape import ShapeRecord
from kiln.placement.fit import plan_replica
from tests.registry.helpers import make_release, post_eval, promote, publish_declared, seal

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = json.loads((ROOT / "examples/llama-3-70b/config.json").read_text())
GIB = 2**30
CONTEXT = 32768

# Llama-3-70B (tests/registry/test_fit.py derives each): parameters, bf16 and FP8 checkpoint bytes, the KV
# cache of one 32K sequence (2 × 80 layers × 8 KV heads × 128 × 32768 × 2 bytes), prefill FLOPs of 32K tokens.
PARAMS = 70_553_706_496
BF16_BYTES = 2 * PARAMS
FP8_BYTES = 72_669_806_592
KV_32K = 10 * GIB
PREFILL_FLOPS = 2 * PARAMS * CONTEXT + 2 * 80 * 64 * 128 * CONTEXT**2

# H200's data sheet (core/hardware.yaml) and NVLink 4's share under TP.
BANDWIDTH = 4800e9
BF16_FLOPS, FP8_FLOPS = 989e12, 1979e12
MEMORY = 141 * GIB
TP_EFFICIENCY = 0.85

# What was measured, in GB/s and TFLOP/s; a range's midpoint.
READ = 4479
DECODE_BF16 = (3942 + 4011) / 2
DECODE_FP8 = (2052 + 2100) / 2
GEMM_BF16 = (707 + 785) / 2
GEMM_FP8 = (1185 + 1425) / 2
GEMM_INT8 = (695 + 840) / 2
ALLOCATABLE = int(139.8 * GIB)


def share(measured: float, peak: float) -> float:
    return round(measured / peak, 4)


READ_SHARE = share(READ, 4800)  # 0.9331
BF16_READ, FP8_READ = share(DECODE_BF16, 4800), share(DECODE_FP8, 4800)  # 0.8284, 0.4325
BF16_MATMUL, FP8_MATMUL = share(GEMM_BF16, 989), share(GEMM_FP8, 1979)  # 0.7543, 0.6594
USABLE = round(0.9 * ALLOCATABLE)  # 125.8 GiB: 90 % of what a process can allocate, not of 141 GiB

# By hand: bf16 needs two devices (141.1 GB + 10 GiB > 125.8 GiB; half of each fits), FP8 one.
BF16_STEP = (BF16_BYTES / 2 / BF16_READ + KV_32K / 2 / READ_SHARE) / (BANDWIDTH * TP_EFFICIENCY)
BF16_TTFT = PREFILL_FLOPS / (2 * BF16_FLOPS * BF16_MATMUL * TP_EFFICIENCY)
FP8_STEP = (FP8_BYTES / FP8_READ + KV_32K / READ_SHARE) / BANDWIDTH
FP8_TTFT = PREFILL_FLOPS / (FP8_FLOPS * FP8_MATMUL)


def test_the_catalog_holds_what_was_measured_on_the_h200() -> None:
    measured = PROFILES["h200"].measured
    assert measured is not None
    assert measured.memory_read == READ_SHARE == 0.9331
    assert (measured.decode.bf16, measured.decode.fp8) == (BF16_READ, FP8_READ) == (0.8284, 0.4325)
    assert (measured.matmul.bf16, measured.matmul.fp8) == (BF16_MATMUL, FP8_MATMUL) == (0.7543, 0.6594)
    assert measured.matmul.int8 == share(GEMM_INT8, 1979) == 0.3878
    assert measured.allocatable_gib == 139.8 and "H200" in measured.source and "PyTorch 2.11" in measured.source
    # Every other SKU is unmeasured.
    assert [p.name for p in PROFILES.values() if p.measured is not None] == ["h200"]


def test_h200_bounds_by_hand() -> None:
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    bf16 = plan_replica(PROFILES["h200"], shape, BF16_BYTES, "bf16", CONTEXT, 1)
    assert BF16_BYTES + KV_32K > USABLE >= (BF16_BYTES + KV_32K) / 2
    assert (bf16.tp, bf16.fits, bf16.usable_per_device_bytes, bf16.memory_per_device_bytes) == (2, True, USABLE, MEMORY)
    assert bf16.decode_tokens_per_s == pytest.approx(1 / BF16_STEP) == pytest.approx(44.87, abs=0.01)
    assert bf16.ttft_s == pytest.approx(BF16_TTFT) == pytest.approx(4.756, abs=1e-3)
    assert bf16.cost_per_mtok == pytest.approx(3.79 * 2 / (3600 / BF16_STEP) * 1e6)
    basis = bf16.basis
    assert (basis.decode, basis.prefill, basis.memory) == ("measured", "measured", "measured")
    assert (basis.bandwidth_fraction, basis.bandwidth_path, basis.kv_bandwidth_fraction) == (0.8284, "decode", 0.9331)
    assert (basis.matmul_fraction, basis.matmul_dtype, basis.allocatable_bytes) == (0.7543, "bf16", ALLOCATABLE)
    assert basis.source is not None and basis.source.startswith("measured on one H200, PyTorch 2.11, CUDA 13")
    assert "125.8 GiB usable of 139.8 GiB allocatable (measured, of 141.0 GiB)" in bf16.explanation
    assert bf16.explanation.endswith(
        "decode at 0.83 × 4,800 GB/s (bf16 decode, measured), KV cache at 0.93 × (memory read, measured), "
        "prefill at 0.75 × 989 TFLOP/s bf16 (measured)"
    )

    fp8 = plan_replica(PROFILES["h200"], shape, FP8_BYTES, "fp8", CONTEXT, 1)
    assert (fp8.tp, fp8.fits) == (1, True)
    assert fp8.decode_tokens_per_s == pytest.approx(1 / FP8_STEP) == pytest.approx(26.74, abs=0.01)
    assert fp8.ttft_s == pytest.approx(FP8_TTFT) == pytest.approx(4.622, abs=1e-3)
    assert (fp8.basis.bandwidth_fraction, fp8.basis.matmul_fraction, fp8.basis.matmul_dtype) == (0.4325, 0.6594, "fp8")
    assert "decode at 0.43 × 4,800 GB/s (fp8 decode, measured)" in fp8.explanation
    assert "prefill at 0.66 × 1,979 TFLOP/s fp8 (measured)" in fp8.explanation


def test_a_weight_path_without_its_own_measurement_is_read_at_the_memory_read_share() -> None:
    """W4A16 dequantizes before a bf16 matmul (no decode chain measured that way): the plain read's share,
    labelled; its matmuls are bf16, measured. INT8 W8A8's matmuls have a measured share, its weights' path none."""
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    w4 = plan_replica(PROFILES["h200"], shape, 36 * GIB, "w4a16-gptq", CONTEXT, 1)
    step = (36 * GIB / READ_SHARE + KV_32K / READ_SHARE) / BANDWIDTH
    assert w4.decode_tokens_per_s == pytest.approx(1 / step)
    assert (w4.basis.bandwidth_path, w4.basis.bandwidth_fraction, w4.basis.matmul_dtype) == (
        "memory_read",
        0.9331,
        "bf16",
    )
    assert "decode at 0.93 × 4,800 GB/s (memory read, measured), prefill at 0.75 × 989 TFLOP/s bf16" in w4.explanation
    int8 = plan_replica(PROFILES["h200"], shape, FP8_BYTES, "int8-w8a8", CONTEXT, 1)
    assert (int8.basis.bandwidth_path, int8.basis.matmul_dtype, int8.basis.matmul_fraction) == (
        "memory_read",
        "int8",
        0.3878,
    )
    assert int8.ttft_s == pytest.approx(PREFILL_FLOPS / (1979e12 * 0.3878))


def test_an_unmeasured_sku_keeps_its_peaks_and_says_so() -> None:
    h100 = plan_replica(PROFILES["h100"], ShapeRecord.from_untrusted(LLAMA_70B), FP8_BYTES, "fp8", CONTEXT, 1)
    assert h100.decode_tokens_per_s == pytest.approx(1 / ((FP8_BYTES / 2 + KV_32K / 2) / (3350e9 * 0.85)))
    assert h100.basis.model_dump() == {
        "decode": "spec",
        "prefill": "spec",
        "memory": "spec",
        "bandwidth_fraction": 1.0,
        "bandwidth_path": "spec",
        "kv_bandwidth_fraction": 1.0,
        "matmul_fraction": 1.0,
        "matmul_dtype": "fp8",
        "allocatable_bytes": None,
        "source": None,
    }
    assert h100.explanation.endswith("bounds at data-sheet peaks (spec): 3,350 GB/s, 1,979 TFLOP/s fp8")


def test_flop_bound_decode_runs_at_the_measured_matmul_share() -> None:
    shape = ShapeRecord.from_untrusted(LLAMA_70B)
    many = plan_replica(PROFILES["h200"], shape, FP8_BYTES, "fp8", 64, 1024, max_devices=8)
    assert many.tp == 1  # 67.7 GiB + 20 GiB of KV cache on one device
    flops_s = 2 * PARAMS * 1024 / (FP8_FLOPS * FP8_MATMUL)
    assert many.decode_tokens_per_s == pytest.approx(1024 / flops_s)
    assert "decode FLOP-bound at 1024 sequences (fp8 matmuls, 0.66 × 1979 TFLOP/s per device)" in many.explanation
    assert many.basis.decode == "measured"


# --- through the API ------------------------------------------------------------------------------------


@pytest.fixture
def llama(app: FastAPI, client: TestClient) -> TestClient:
    """llama@1.0 on prod: hf-bf16 and hf-fp8 of Llama-3-70B for h100 and h200 (declared blobs of their sizes)."""
    make_release(client, model="llama", model_config=LLAMA_70B, planned=["hf-bf16", "hf-fp8"])
    for name, size, quant in (("hf-bf16", BF16_BYTES, "bf16"), ("hf-fp8", FP8_BYTES, "fp8")):
        publish_declared(
            client,
            app,
            name,
            size,
            ["h100", "h200"],
            model="llama",
            quant=quant,
            target="hf-bundle",
            format="safetensors",
        )
        assert post_eval(client, name, "passed", runtime="vllm", model="llama", metrics={"kl": 0.0}).is_success
    seal(client, model="llama")
    assert promote(client, model="llama").status_code == 200
    return client


def reasons(client: TestClient, hardware: str) -> dict[str, dict[str, Any]]:
    """Each artifact's reason in the answer for `hardware` (the chosen one and the fallbacks)."""
    answer = client.get("/v1/resolve", params={"model": "llama", "hardware": hardware, "context": CONTEXT})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return {c["artifact"]["name"]: c["reason"] for c in [body, *body["fallbacks"]]}


def test_resolve_answers_with_the_measured_bounds_and_their_basis(llama: TestClient) -> None:
    h200 = reasons(llama, "h200")
    bf16, fp8 = h200["hf-bf16"], h200["hf-fp8"]
    assert bf16["decode_tokens_per_s_bound"] == pytest.approx(1 / BF16_STEP)
    assert bf16["ttft_ms"] == pytest.approx(BF16_TTFT * 1000)
    assert fp8["decode_tokens_per_s_bound"] == pytest.approx(1 / FP8_STEP)
    assert fp8["ttft_ms"] == pytest.approx(FP8_TTFT * 1000)
    assert (bf16["usable_bytes"], bf16["memory_bytes"]) == (USABLE, MEMORY)
    for reason, read, matmul in ((bf16, 0.8284, 0.7543), (fp8, 0.4325, 0.6594)):
        basis = reason["basis"]
        assert (basis["decode"], basis["prefill"], basis["memory"]) == ("measured", "measured", "measured")
        assert (basis["bandwidth_fraction"], basis["matmul_fraction"]) == (read, matmul)
        assert basis["source"].startswith("measured on one H200")
    assert "prefill at 0.75 × 989 TFLOP/s bf16 (measured)" in bf16["explanation"]

    h100 = reasons(llama, "h100")["hf-fp8"]
    assert h100["basis"]["decode"] == h100["basis"]["prefill"] == h100["basis"]["memory"] == "spec"
    assert h100["basis"]["source"] is None and "(spec)" in h100["explanation"]


def test_an_admin_records_measured_shares_for_h100_and_its_answer_changes(llama: TestClient) -> None:
    before = llama.get("/v1/resolve", params={"model": "llama", "hardware": "h100", "context": CONTEXT})
    spec = {r["artifact"]["name"]: r["reason"] for r in [before.json(), *before.json()["fallbacks"]]}["hf-fp8"]
    measured = {
        "memory_read": 0.9,
        "decode": {"bf16": 0.8, "fp8": 0.5},
        "matmul": {"bf16": 0.7, "fp8": 0.6},
        "allocatable_gib": 79.2,
        "source": "an H100 SXM, PyTorch 2.11, CUDA events",
        "measured_on": "2026-11-26",
    }
    entry = llama.get("/v1/hardware/h100").json()
    put = llama.put("/v1/hardware/h100", json={**entry, "measured": measured})
    assert put.status_code == 200, put.text
    unmeasured = {"bf16": None, "fp8": None, "int8": None, "fp4": None}
    assert put.json()["measured"] == {
        **measured,
        "decode": {**unmeasured, **measured["decode"]},
        "matmul": {**unmeasured, **measured["matmul"]},
        "matmul_small_m": unmeasured,
    }
    assert llama.get("/v1/hardware/h100").json() == put.json()

    after = llama.get("/v1/resolve", params={"model": "llama", "hardware": "h100", "context": CONTEXT})
    assert after.headers["ETag"] != before.headers["ETag"]
    fp8 = {r["artifact"]["name"]: r["reason"] for r in [after.json(), *after.json()["fallbacks"]]}["hf-fp8"]
    # 90 % of 79.2 GiB (71.3) does not hold FP8's 67.7 GiB + 10 GiB either: two devices, each reading half.
    assert fp8["tp"] == spec["tp"] == 2 and fp8["usable_bytes"] == round(0.9 * int(79.2 * GIB))
    step = (FP8_BYTES / 2 / 0.5 + KV_32K / 2 / 0.9) / (3350e9 * 0.85)
    assert fp8["decode_tokens_per_s_bound"] == pytest.approx(1 / step)
    assert fp8["ttft_ms"] == pytest.approx(PREFILL_FLOPS / (2 * 1979e12 * 0.6 * 0.85) * 1000)
    assert fp8["decode_tokens_per_s_bound"] < spec["decode_tokens_per_s_bound"]
    assert fp8["basis"] == {
        "decode": "measured",
        "prefill": "measured",
        "memory": "measured",
        "bandwidth_fraction": 0.5,
        "bandwidth_path": "decode",
        "kv_bandwidth_fraction": 0.9,
        "matmul_fraction": 0.6,
        "matmul_dtype": "fp8",
        "allocatable_bytes": int(79.2 * GIB),
        "source": "an H100 SXM, PyTorch 2.11, CUDA events, 2026-11-26",
    }
    audit = next(e for e in llama.get("/v1/audit").json() if e["action"] == "hardware.put")
    assert (
        audit["details"]["before"]["measured"] is None and audit["details"]["after"]["measured"]["memory_read"] == 0.9
    )

    # Removing the registry's entry returns h100 to its built-in (unmeasured) one, and its answer to spec.
    assert llama.delete("/v1/hardware/h100").status_code == 204
    assert reasons(llama, "h100")["hf-fp8"] == spec


BAD_MEASURED: list[tuple[dict[str, Any], str]] = [  # (change to a measured record, the problem named)
    ({"memory_read": 0}, "measured.memory_read: Input should be greater than or equal to 0.0001"),
    ({"memory_read": 2.5}, "measured.memory_read: Input should be less than or equal to 2"),
    ({"memory_read": "0.9"}, "measured.memory_read: Input should be a valid number"),
    ({"decode": {"bf16": True}}, "measured.decode.bf16: Input should be a valid number"),
    ({"decode": {"fp4": 0.5}}, "measured.decode.fp4 is given for a device without fp4 matmuls"),
    ({"matmul": {"fp6": 0.5}}, "measured.matmul.fp6: Extra inputs are not permitted"),
    ({"allocatable_gib": 0.5}, "measured.allocatable_gib: Input should be greater than or equal to 1"),
    ({"measured_on": "2026-13-01"}, "is not a date"),
    ({"measured_on": "yesterday"}, "measured.measured_on: String should match pattern"),
    ({"source": ""}, "measured.source: String should have at least 1 character"),
    ({"source": "a\nb"}, "source is printable text"),
    ({"colour": "green"}, "measured.colour: Extra inputs are not permitted"),
]


def test_a_bad_measured_record_is_refused_naming_the_field(client: TestClient) -> None:
    good = {"memory_read": 0.9, "source": "a run", "measured_on": "2026-11-26"}
    for change, problem in BAD_MEASURED:
        entry = {**builtin_catalog().profiles["h100"].model_dump(mode="json"), "measured": {**good, **change}}
        response = client.put("/v1/hardware/h100", json=entry)
        assert response.status_code == 422, (change, response.text)
        error = response.json()["error"]
        assert error["code"] == "HARDWARE_CATALOG_INVALID" and problem in error["message"], (change, error)
    assert client.get("/v1/hardware/h100").json()["source"] == "builtin"
