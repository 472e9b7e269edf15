"""Routing through the HTTP API: resolve across hardware pools by policy and SLO, measured performance
over estimates, the hardware catalog as admins change it, weighted channel splits with stable keys,
ETags and long-polls, and hostile query values.

The fleet here is Llama-3-70B (its real config, examples/llama-3-70b) in bf16 (141.1 GB) and FP8
(72.7 GB: the footprint of `quant.footprint.checkpoint_bytes`) at 32K context, whose KV cache is
10 GiB: FP8 needs two H100s (77.7 GiB > 72 GiB usable of 80) and bf16 two as well, while one MI300X
(172.8 GiB usable of 192) holds bf16. With the catalog's bandwidths and prices that makes each
policy choose differently:

    h100   hf-fp8   TP 2  68.3 tokens/s per sequence  $24.3/Mtok  TTFT 1.79 s  kl 0.02
    h100   hf-bf16  TP 2  37.5                        $44.3       TTFT 3.59 s  kl 0
    mi300x hf-bf16  TP 1  34.9                        $19.8       TTFT 4.61 s  kl 0

The checkpoints' bytes are declared blobs (`helpers.declare_blob`): only their sizes matter here.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.core.hardware import builtin_catalog
from tests.registry.conftest import make_token
from tests.registry.helpers import (
    assert_error,
    make_release,
    post_eval,
    promote,
    publish,
    publish_declared,
    seal,
    serve_in_thread,
)

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = json.loads((ROOT / "examples/llama-3-70b/config.json").read_text())
GIB = 1024**3
BF16_70B = 141_107_412_992
FP8_70B = 72_669_806_592
KV_32K = 2 * 80 * 8 * 128 * 32768 * 2  # keys and values, 80 layers, 8 KV heads of 128, bf16: 10 GiB
H100_USABLE = round(0.9 * 80 * GIB)
MI300X_USABLE = round(0.9 * 192 * GIB)
FLEET: dict[str, Any] = {"model": "llama", "hardware": "h100,mi300x", "context": 32768}
PERF = "/v1/models/llama/releases/1.0/artifacts/hf-fp8/performance"
JSON = {"Content-Type": "application/json"}  # for bodies sent as text: NaN and Infinity, or not JSON at all


def resolve(client: TestClient, **params: Any) -> Any:
    return client.get("/v1/resolve", params={**FLEET, **params})


def ranking(answer: dict[str, Any]) -> list[tuple[str, str, int, bool]]:
    """(hardware, artifact, TP, fits) of the answer and its fallbacks, in order."""
    return [
        (c["hardware"], c["artifact"]["name"], c["reason"]["tp"], c["reason"]["fits"])
        for c in [answer, *answer["fallbacks"]]
    ]


def candidate(answer: dict[str, Any], hardware: str, artifact: str) -> dict[str, Any]:
    """The reason given for one (hardware, artifact) candidate, the chosen one or a fallback."""
    reason: dict[str, Any] = next(
        c["reason"]
        for c in [answer, *answer["fallbacks"]]
        if (c["hardware"], c["artifact"]["name"]) == (hardware, artifact)
    )
    return reason


@pytest.fixture
def fleet(app: FastAPI, client: TestClient) -> TestClient:
    """llama@1.0 on prod: hf-bf16 for h100 and mi300x (kl 0), hf-fp8 (e4m3fn) for h100 only (kl 0.02)."""
    make_release(client, model="llama", model_config=LLAMA_70B, planned=["hf-bf16", "hf-fp8"])
    for name, size, hardware, quant in (
        ("hf-bf16", BF16_70B, ["h100", "mi300x"], "bf16"),
        ("hf-fp8", FP8_70B, ["h100"], "fp8"),
    ):
        publish_declared(
            client, app, name, size, hardware, model="llama", quant=quant, target="hf-bundle", format="safetensors"
        )
    assert post_eval(client, "hf-bf16", "passed", runtime="vllm", model="llama", metrics={"kl": 0.0}).is_success
    assert post_eval(client, "hf-fp8", "passed", runtime="vllm", model="llama", metrics={"kl": 0.02}).is_success
    seal(client, model="llama")
    assert promote(client, model="llama").status_code == 200
    return client


# --- pools and policies ---------------------------------------------------------------------------


def test_each_policy_chooses_its_own_candidate_across_pools_and_says_why(fleet: TestClient) -> None:
    latency = resolve(fleet, policy="latency").json()
    assert ranking(latency) == [
        ("h100", "hf-fp8", 2, True),
        ("h100", "hf-bf16", 2, True),
        ("mi300x", "hf-bf16", 1, True),
    ]
    assert latency["explanation"] == (
        "policy latency: hf-fp8 on h100 (TP 2) is the fastest per sequence of 3 candidates that fit across h100, mi300x"
    )
    cost = resolve(fleet, policy="cost").json()
    assert ranking(cost) == [
        ("mi300x", "hf-bf16", 1, True),
        ("h100", "hf-fp8", 2, True),
        ("h100", "hf-bf16", 2, True),
    ]
    assert cost["explanation"].startswith("policy cost: hf-bf16 on mi300x (TP 1) is the cheapest per million tokens")
    quality = resolve(fleet, policy="quality").json()
    assert ranking(quality) == [
        ("h100", "hf-bf16", 2, True),  # kl 0 on both pools: the faster one
        ("mi300x", "hf-bf16", 1, True),
        ("h100", "hf-fp8", 2, True),
    ]
    assert quality["explanation"].startswith("policy quality: hf-bf16 on h100 (TP 2) is the lowest KL divergence")
    for policy, answer in (("latency", latency), ("cost", cost), ("quality", quality)):
        assert (answer["policy"], answer["version"], answer["split"]) == (policy, "1.0", None)

    # The numbers behind it, by hand from the catalog (bandwidth GB/s, TP efficiency, price per device-hour).
    fp8 = latency["reason"]
    assert fp8["memory_bytes"] == 80 * GIB and fp8["usable_bytes"] == H100_USABLE
    assert fp8["required_bytes"] == FP8_70B // 2 + KV_32K // 2
    assert fp8["kv_cache_bytes"] == KV_32K
    assert fp8["tokens_per_s_per_sequence"] == pytest.approx(3350e9 * 0.85 / fp8["required_bytes"])
    assert fp8["cost_per_mtok"] == pytest.approx(2.99 * 2 / (fp8["tokens_per_s"] * 3600) * 1e6)
    assert "TP 2 of 8 (NVLink 4)" in fp8["explanation"] and "TP 1 needs 77.7 GiB" in fp8["explanation"]
    mi300x = cost["reason"]
    assert (mi300x["usable_bytes"], mi300x["required_bytes"]) == (MI300X_USABLE, BF16_70B + KV_32K)
    assert mi300x["tokens_per_s_per_sequence"] == pytest.approx(5300e9 / (BF16_70B + KV_32K))
    assert mi300x["cost_per_mtok"] == pytest.approx(2.49 / (mi300x["tokens_per_s"] * 3600) * 1e6)
    assert mi300x["cost_per_mtok"] < fp8["cost_per_mtok"] and mi300x["kl"] == 0.0
    # Fallbacks are whole answers for their pool: each names its hardware and its own download URLs.
    fallback = latency["fallbacks"][-1]
    assert fallback["hardware"] == "mi300x"
    assert fallback["artifact"]["files"][0]["url"].endswith(
        "/llama/releases/1.0/artifacts/hf-bf16/files/model.safetensors"
    )


def test_a_pool_without_free_devices_for_tp_2_ranks_its_candidates_last(fleet: TestClient) -> None:
    answer = resolve(fleet, hardware="h100:1,mi300x").json()
    assert ranking(answer) == [
        ("mi300x", "hf-bf16", 1, True),
        ("h100", "hf-fp8", 1, False),
        ("h100", "hf-bf16", 1, False),
    ]
    assert "of 1 candidate that fit" in answer["explanation"]
    fp8 = candidate(answer, "h100", "hf-fp8")
    assert fp8["required_bytes"] == FP8_70B + KV_32K > fp8["usable_bytes"] == H100_USABLE
    assert "does not fit in 1 device: TP 1 needs 67.7 GiB weights + 10.0 GiB KV" in fp8["explanation"]
    # Two free devices are enough again.
    assert ranking(resolve(fleet, hardware="h100:2,mi300x").json())[0] == ("h100", "hf-fp8", 2, True)
    # A pool of one free H100 alone: nothing fits, and the error gives each candidate's numbers.
    error = assert_error(resolve(fleet, hardware="h100:1"), 404, "NO_COMPATIBLE_ARTIFACT")
    assert "hf-fp8 on h100 needs TP 1 × 77.68 GiB" in error["message"] and "1 free" in error["message"]
    assert [(c["artifact"], c["tp"]) for c in error["details"]["candidates"]] == [("hf-fp8", 1), ("hf-bf16", 1)]


def test_the_slo_filters_candidates_and_slo_unmet_says_what_the_best_reaches(fleet: TestClient) -> None:
    # Only FP8 on two H100s prefills 32K tokens in under 2 s: it wins even under the quality and cost policies.
    for policy in ("quality", "cost"):
        answer = resolve(fleet, policy=policy, max_ttft_ms=2000).json()
        assert (answer["hardware"], answer["artifact"]["name"]) == ("h100", "hf-fp8"), policy
        assert answer["reason"]["meets_slo"] is True and answer["reason"]["ttft_ms"] < 2000
        assert [f["reason"]["meets_slo"] for f in answer["fallbacks"]] == [False, False]
        assert "misses the SLO: TTFT" in answer["fallbacks"][0]["reason"]["explanation"]
        assert "of 1 candidate that fit meeting TTFT ≤ 2000 ms" in answer["explanation"]
    # 36 tokens/s per sequence rules out the MI300X (34.9) under the cost policy.
    answer = resolve(fleet, policy="cost", min_tokens_per_s=36).json()
    assert ranking(answer)[0] == ("h100", "hf-fp8", 2, True)
    assert candidate(answer, "mi300x", "hf-bf16")["meets_slo"] is False
    assert "meeting ≥ 36 tokens/s per sequence" in answer["explanation"]

    error = assert_error(resolve(fleet, min_tokens_per_s=100), 404, "SLO_UNMET")
    assert "the best, hf-fp8 on h100: 68.3 < 100 tokens/s per sequence" in error["message"]
    best = error["details"]["best"]
    assert (best["artifact"], best["hardware"]) == ("hf-fp8", "h100")
    assert best["tokens_per_s_per_sequence"] == pytest.approx(68.3, abs=0.05)
    error = assert_error(resolve(fleet, max_ttft_ms=1000, min_tokens_per_s=10), 404, "SLO_UNMET")
    assert "TTFT 1793 > 1000 ms" in error["message"]


def test_an_fp8_kv_cache_halves_the_kv_cache(fleet: TestClient) -> None:
    bf16 = resolve(fleet, policy="cost").json()
    fp8 = resolve(fleet, policy="cost", kv_cache_dtype="fp8").json()
    for hardware, artifact in (("mi300x", "hf-bf16"), ("h100", "hf-fp8"), ("h100", "hf-bf16")):
        full, half = candidate(bf16, hardware, artifact), candidate(fp8, hardware, artifact)
        assert (full["kv_cache_bytes"], half["kv_cache_bytes"]) == (KV_32K, KV_32K // 2)
        assert full["required_bytes"] - half["required_bytes"] == KV_32K // 2 // full["tp"]
        assert half["tokens_per_s_per_sequence"] > full["tokens_per_s_per_sequence"]
    assert candidate(fp8, "mi300x", "hf-bf16")["required_bytes"] == BF16_70B + KV_32K // 2


# --- measured performance -------------------------------------------------------------------------


def record(**fields: Any) -> dict[str, Any]:
    """A measurement of hf-fp8 on two H100s at 32K × 1, slower than the estimate (25 tokens/s)."""
    return {
        "hardware": "h100",
        "runtime": "vllm",
        "runtime_version": "vLLM 0.32.0, CUDA 12.8",
        "tp": 2,
        "context": 32768,
        "concurrency": 1,
        "tokens_per_s": 25.0,
        "ttft_ms": 2100.0,
        "itl_p50_ms": 40.0,
        "itl_p99_ms": 55.0,
        **fields,
    }


def test_a_measured_record_replaces_the_estimate_and_the_answer_says_so(fleet: TestClient) -> None:
    # Records at another TP, concurrency, or a shorter context do not speak for this replica.
    for other in (record(tp=4), record(concurrency=8), record(context=16384)):
        assert fleet.post(PERF, json=other).status_code == 201
    answer = resolve(fleet).json()
    assert ranking(answer)[0] == ("h100", "hf-fp8", 2, True)
    assert (answer["reason"]["speed_source"], answer["reason"]["measured"]) == ("estimate", None)
    assert (
        "measured on h100 only at TP 2, 16384 × 1, TP 2, 32768 × 8, TP 4, 32768 × 1" in answer["reason"]["explanation"]
    )

    posted = fleet.post(PERF, json=record(context=65536))  # a longer context speaks for a shorter one
    assert posted.status_code == 201, posted.text
    assert posted.json()["recorded_by"] == "token:test-admin"
    answer = resolve(fleet).json()
    # Measured at 25 tokens/s per sequence, FP8 falls behind both bf16 estimates.
    assert ranking(answer) == [
        ("h100", "hf-bf16", 2, True),
        ("mi300x", "hf-bf16", 1, True),
        ("h100", "hf-fp8", 2, True),
    ]
    fp8 = candidate(answer, "h100", "hf-fp8")
    assert fp8["speed_source"] == "measured"
    assert fp8["measured"]["id"] == posted.json()["id"] and fp8["measured"]["context"] == 65536
    assert (fp8["tokens_per_s"], fp8["tokens_per_s_per_sequence"], fp8["ttft_ms"]) == (25.0, 1000 / 40, 2100.0)
    assert fp8["cost_per_mtok"] == pytest.approx(2.99 * 2 / (25 * 3600) * 1e6)
    assert fp8["decode_tokens_per_s_bound"] == pytest.approx(68.3, abs=0.05)  # the bound is still shown
    assert "measured by vLLM 0.32.0, CUDA 12.8 on h100 (TP 2, context 65536 × 1): 25 tokens/s" in fp8["explanation"]
    assert answer["reason"]["speed_source"] == "estimate"
    # The nearest context wins over a longer one.
    nearest = fleet.post(PERF, json=record(tokens_per_s=24.0)).json()
    assert candidate(resolve(fleet).json(), "h100", "hf-fp8")["measured"]["id"] == nearest["id"]
    listed = fleet.get(PERF).json()
    assert [r["context"] for r in listed] == [32768, 65536, 16384, 32768, 32768]  # newest first
    assert listed[0]["artifact"] == "hf-fp8"


BAD_RECORDS: list[tuple[dict[str, Any], str, str]] = [
    (record(itl_p50_ms=40.0, itl_p99_ms=39.0), "PERFORMANCE_INVALID", "below itl_p50_ms"),
    (record(tp=16), "PERFORMANCE_INVALID", "8 devices of a h100 node"),
    (record(hardware="mi300x"), "PERFORMANCE_INVALID", "does not run on mi300x"),
    (record(hardware="h20"), "UNKNOWN_NAME", "unknown hardware 'h20'"),
    (record(tokens_per_s=math.nan), "INVALID_JSON", "NaN"),  # not JSON, so refused before the fields
    (record(ttft_ms=-1.0), "INVALID_INPUT", "ttft_ms"),
    (record(itl_p50_ms=math.inf), "INVALID_JSON", "Infinity"),
    (record(tokens_per_s=1e400), "INVALID_JSON", "Infinity"),
    (record(tokens_per_s=0), "INVALID_INPUT", "tokens_per_s"),
    (record(tp=0), "INVALID_INPUT", "tp"),
    (record(tp="two"), "INVALID_INPUT", "tp"),
    (record(hardware="H100"), "INVALID_INPUT", "hardware"),
    (record(gpu="h100"), "INVALID_INPUT", "gpu"),
]


def test_bad_performance_records_are_refused_with_a_code(fleet: TestClient) -> None:
    for body, code, named in BAD_RECORDS:
        error = assert_error(fleet.post(PERF, content=json.dumps(body), headers=JSON), 422, code)
        assert named in error["message"] or named in json.dumps(error["details"]), (body, error)
    assert fleet.get(PERF).json() == []


def test_a_yanked_release_takes_no_performance_records(fleet: TestClient) -> None:
    assert fleet.post(PERF, json=record()).status_code == 201
    assert fleet.post("/v1/models/llama/releases/1.0/yank", json={"reason": "bad weights"}).status_code == 200
    error = assert_error(fleet.post(PERF, json=record(tokens_per_s=99.0)), 409, "RELEASE_YANKED")
    assert error["details"] == {"model": "llama", "version": "1.0"}
    assert len(fleet.get(PERF).json()) == 1


def test_a_read_token_cannot_post_performance(app: FastAPI, fleet: TestClient) -> None:
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['read'], name='reader')}"}) as reader:
        assert_error(reader.post(PERF, json=record()), 403, "FORBIDDEN")
        assert reader.get(PERF).json() == []
    assert_error(TestClient(app).post(PERF, json=record()), 401, "UNAUTHORIZED")


# --- the hardware catalog -------------------------------------------------------------------------


BUILTIN_H100 = builtin_catalog().profiles["h100"].model_dump(mode="json")


def h100_entry(**changes: Any) -> dict[str, Any]:
    """The built-in H100 entry (a catalog entry as PUT takes one), with `changes`."""
    return {**BUILTIN_H100, **changes}


def test_the_catalog_lists_and_shows_entries(client: TestClient) -> None:
    listed = client.get("/v1/hardware").json()
    names = [e["name"] for e in listed]
    assert {"h100", "h200", "mi300x", "tpu-v5e", "cpu"} <= set(names)
    assert {e["source"] for e in listed} == {"builtin"}
    h100 = client.get("/v1/hardware/h100").json()
    assert h100 == next(e for e in listed if e["name"] == "h100") == {**BUILTIN_H100, "source": "builtin"}
    assert (h100["memory_gib"], h100["compute_capability"], h100["fp8"], h100["devices_per_node"]) == (
        80,
        90,
        "e4m3fn",
        8,
    )
    assert h100["interconnect"] == {"name": "NVLink 4", "bandwidth_gbs": 900, "tp_efficiency": 0.85}
    assert_error(client.get("/v1/hardware/H100"), 422, "INVALID_INPUT")


def test_an_unknown_sku_is_not_found(client: TestClient) -> None:
    response = client.get("/v1/hardware/h20")
    assert response.status_code == 404, response.text
    assert "h100" in response.json()["error"]["message"]  # the known names


def test_an_admin_adds_an_sku_and_resolve_serves_it_at_once(app: FastAPI, fleet: TestClient) -> None:
    assert_error(resolve(fleet, hardware="h20"), 422, "UNKNOWN_NAME")
    # An admin copies h100's entry as the API shows it (its source included) and changes what differs.
    changes = {"name": "h20", "memory_gib": 96, "products": ["H20", "NVIDIA H20"], "price_per_device_hour": 1.5}
    put = fleet.put("/v1/hardware/h20", json={**fleet.get("/v1/hardware/h100").json(), **changes})
    assert put.status_code == 200, put.text
    assert put.json() == {**h100_entry(**changes), "source": "registry"}
    assert fleet.get("/v1/hardware/h20").json() == put.json()
    assert "h20" in [e["name"] for e in fleet.get("/v1/hardware").json()]

    # Artifacts built for h100 run on its architecture twin; 86.4 GiB usable of 96 holds FP8 on one device.
    answer = resolve(fleet, hardware="h20").json()
    assert ranking(answer) == [("h20", "hf-fp8", 1, True), ("h20", "hf-bf16", 2, True)]
    reason = answer["reason"]
    assert (reason["memory_bytes"], reason["usable_bytes"]) == (96 * GIB, round(0.9 * 96 * GIB))
    assert reason["required_bytes"] == FP8_70B + KV_32K
    assert reason["cost_per_mtok"] == pytest.approx(1.5 / (reason["tokens_per_s"] * 3600) * 1e6)
    assert "hf-fp8 on h20 as h100 (same architecture, sm90)" in reason["explanation"]
    # The same artifacts on h100 in the same query still need two devices.
    assert ranking(resolve(fleet, hardware="h20,h100").json())[:2] == [
        ("h100", "hf-fp8", 2, True),
        ("h20", "hf-fp8", 1, True),
    ]
    # The twin can be measured like any SKU the artifact runs on, and the measurement is used.
    posted = fleet.post(PERF, json=record(hardware="h20", tp=1, context=32768, tokens_per_s=55.0))
    assert posted.status_code == 201, posted.text
    measured = candidate(resolve(fleet, hardware="h20").json(), "h20", "hf-fp8")
    assert measured["speed_source"] == "measured" and measured["measured"]["id"] == posted.json()["id"]

    audit = [e for e in fleet.get("/v1/audit").json() if e["target"] == "hardware/h20"]
    assert [e["action"] for e in audit] == ["hardware.put"]
    assert audit[0]["actor"] == "token:test-admin"
    assert audit[0]["details"]["before"] is None
    assert audit[0]["details"]["after"]["memory_gib"] == 96 and audit[0]["details"]["after"]["name"] == "h20"

    assert fleet.delete("/v1/hardware/h20").status_code == 204
    assert_error(resolve(fleet, hardware="h20"), 422, "UNKNOWN_NAME")
    audit = [e for e in fleet.get("/v1/audit").json() if e["target"] == "hardware/h20"]
    assert [e["action"] for e in audit] == ["hardware.delete", "hardware.put"]
    assert audit[0]["details"] == {"before": audit[1]["details"]["after"], "after": None}


def test_a_body_naming_another_sku_than_the_path_is_refused(client: TestClient) -> None:
    response = client.put("/v1/hardware/h100", json=h100_entry(name="h20", memory_gib=96))
    error = assert_error(response, 422, "HARDWARE_CATALOG_INVALID")
    assert "name" in error["message"] and "h20" in error["message"]
    assert client.get("/v1/hardware/h100").json()["memory_gib"] == 80


def test_only_admins_change_the_catalog(app: FastAPI, client: TestClient) -> None:
    for scopes in (["read"], ["publish"], ["promote"]):
        token = make_token(app, scopes, name=f"only-{scopes[0]}")
        with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as other:
            assert other.get("/v1/hardware/h100").status_code == 200
            assert_error(other.put("/v1/hardware/h20", json=h100_entry(name="h20")), 403, "FORBIDDEN")
            assert_error(other.put("/v1/hardware/h100", json=h100_entry(price_per_device_hour=0)), 403, "FORBIDDEN")
            assert_error(other.delete("/v1/hardware/h100"), 403, "FORBIDDEN")
    assert_error(TestClient(app).put("/v1/hardware/h20", json=h100_entry(name="h20")), 401, "UNAUTHORIZED")
    assert "h20" not in [e["name"] for e in client.get("/v1/hardware").json()]
    assert client.get("/v1/hardware/h100").json()["price_per_device_hour"] == 2.99
    assert not [e for e in client.get("/v1/audit").json() if e["action"].startswith("hardware.")]


BAD_ENTRIES: list[tuple[dict[str, Any], str]] = [  # (change to h100's entry, the problem named)
    (
        {"compute_capability": None},
        "compute_capability is given for NVIDIA (family cuda) devices",
    ),  # family cuda needs it
    (
        {"family": "rocm"},
        "compute_capability is given for NVIDIA (family cuda) devices, and only",
    ),  # and only cuda has one
    ({"memory_gib": -80}, "memory_gib: Input should be greater than or equal to 1"),
    ({"memory_gib": 0}, "memory_gib: Input should be greater than or equal to 1"),
    ({"memory_gib": "lots"}, "memory_gib: Input should be a valid number"),
    ({"bandwidth_gbs": 1e8}, "bandwidth_gbs: Input should be less than or equal to 100000"),
    ({"devices_per_node": 2.5}, "devices_per_node: Input should be a valid integer"),
    ({"tflops": "fast"}, "tflops: Input should be a valid dictionary"),
    ({"tflops": {"bf16": 989, "fp6": 4000}}, "tflops.fp6: Extra inputs are not permitted"),
    ({"tflops": {"bf16": 989, "fp8": 1979, "fp4": 4000}}, "tflops.fp4 is given exactly for a device with FP4 units"),
    ({"fp4": ["nvfp4"]}, "tflops.fp4 is given exactly for a device with FP4 units"),  # formats without a rate
    ({"fp4": ["nvfp6"]}, "fp4.0: Input should be 'nvfp4' or 'mxfp4'"),
    ({"interconnect": {"name": "NVLink 4", "bandwidth_gbs": 900, "tp_efficiency": 1.5}}, "interconnect.tp_efficiency:"),
    ({"interconnect": None}, "a node of several devices needs its interconnect"),  # eight devices need one for TP
    ({"fp8": "e5m2"}, "fp8: Input should be 'e4m3fn' or 'e4m3fnuz'"),
    ({"family": "gpu"}, "family: Input should be"),
    ({"colour": "green"}, "colour: Extra inputs are not permitted"),
    ({"price_per_device_hour": -1}, "price_per_device_hour: Input should be greater than or equal to 0"),
    ({"products": ["x" * 65]}, "products are printable names of 1 to 64 characters"),
]


def test_an_invalid_catalog_entry_is_refused_naming_the_field(client: TestClient) -> None:
    for change, problem in BAD_ENTRIES:
        response = client.put("/v1/hardware/h20", json=h100_entry(name="h20", **change))
        error = assert_error(response, 422, "HARDWARE_CATALOG_INVALID")
        assert error["message"].startswith("hardware entry 'h20': ") and problem in error["message"], (change, error)
    assert "h20" not in [e["name"] for e in client.get("/v1/hardware").json()]
    assert not [e for e in client.get("/v1/audit").json() if e["action"].startswith("hardware.")]


def test_a_catalog_body_that_is_not_an_entry_is_422(client: TestClient) -> None:
    for body, code in (
        ("[]", "INVALID_INPUT"),
        ('"h100"', "INVALID_INPUT"),
        ("", "INVALID_INPUT"),
        ("{", "INVALID_JSON"),
    ):
        assert_error(client.put("/v1/hardware/h20", content=body, headers=JSON), 422, code)
    assert "h20" not in [e["name"] for e in client.get("/v1/hardware").json()]


def test_a_builtin_entry_is_overridden_not_deleted(fleet: TestClient) -> None:
    error = assert_error(fleet.delete("/v1/hardware/h100"), 404, "HARDWARE_NOT_FOUND")
    assert "built-in entries can be overridden (PUT), not deleted" in error["message"]
    assert_error(fleet.delete("/v1/hardware/h20"), 404, "HARDWARE_NOT_FOUND")
    assert fleet.get("/v1/hardware/h100").json()["source"] == "builtin"

    before = candidate(resolve(fleet).json(), "h100", "hf-fp8")["cost_per_mtok"]
    put = fleet.put("/v1/hardware/h100", json=h100_entry(price_per_device_hour=5.98))
    assert put.status_code == 200, put.text
    assert put.json()["source"] == "registry (overrides builtin)"
    overridden = resolve(fleet).json()
    assert candidate(overridden, "h100", "hf-fp8")["cost_per_mtok"] == pytest.approx(2 * before)
    assert candidate(overridden, "mi300x", "hf-bf16")["cost_per_mtok"] == pytest.approx(19.8, abs=0.05)
    audit = next(e for e in fleet.get("/v1/audit").json() if e["action"] == "hardware.put")
    assert audit["details"]["before"]["price_per_device_hour"] == 2.99
    assert audit["details"]["after"]["price_per_device_hour"] == 5.98

    assert fleet.delete("/v1/hardware/h100").status_code == 204
    assert fleet.get("/v1/hardware/h100").json() == {**BUILTIN_H100, "source": "builtin"}
    assert candidate(resolve(fleet).json(), "h100", "hf-fp8")["cost_per_mtok"] == pytest.approx(before)
    assert_error(fleet.delete("/v1/hardware/h100"), 404, "HARDWARE_NOT_FOUND")


# --- weighted splits ------------------------------------------------------------------------------

KEYS = [f"session-{i}" for i in range(2000)]
SPLIT = "/v1/models/tiny/channels/prod/split"


def weights(*pairs: tuple[str, Any]) -> dict[str, Any]:
    return {"weights": [{"version": v, "weight": w} for v, w in pairs]}


@pytest.fixture
def canary(client: TestClient) -> TestClient:
    """tiny@1.0 on prod and tiny@2.0, each one small gguf-q8 for cpu that passed its eval, both sealed."""
    for version in ("1.0", "2.0"):
        make_release(client, version=version)
        publish(client, "gguf-q8", {"model.gguf": version.encode() * 50}, ["cpu"], version=version)
        assert post_eval(client, "gguf-q8", "passed", version=version).is_success
        seal(client, version)
    assert promote(client, "1.0").status_code == 200
    return client


@pytest.fixture
def live(app: FastAPI, canary: TestClient) -> Iterator[httpx2.Client]:
    """The seeded app served by uvicorn on a free loopback port, and a client of it."""
    with serve_in_thread(app) as port, httpx2.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        yield http


def versions_by_key(client: httpx2.Client, keys: list[str]) -> dict[str, str]:
    """The release resolve answers each key with (tiny on prod, cpu)."""
    chosen = {}
    for key in keys:
        response = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu", "key": key})
        assert response.status_code == 200, response.text
        chosen[key] = response.json()["version"]
    return chosen


def test_a_split_sends_each_key_to_a_stable_release_at_its_weight(canary: TestClient, live: httpx2.Client) -> None:
    response = canary.put(SPLIT, json=weights(("1.0", 95), ("2.0", 5)))
    assert response.status_code == 200, response.text
    assert response.json()["split"] == [{"version": "1.0", "weight": 95.0}, {"version": "2.0", "weight": 5.0}]
    first = versions_by_key(live, KEYS)
    shares = Counter(first.values())
    assert set(shares) == {"1.0", "2.0"}
    assert abs(shares["2.0"] / len(KEYS) - 0.05) <= 0.02, shares
    # The same key, asked again, lands on the same release.
    assert versions_by_key(live, KEYS[:300]) == {k: first[k] for k in KEYS[:300]}
    answer = live.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu", "key": KEYS[0]}).json()
    assert answer["split"] == [
        {"version": "1.0", "weight": 95.0, "chosen": first[KEYS[0]] == "1.0"},
        {"version": "2.0", "weight": 5.0, "chosen": first[KEYS[0]] == "2.0"},
    ]

    # Growing the canary to 10 %: every key on it stays, and only keys of 1.0 move to it.
    assert canary.put(SPLIT, json=weights(("2.0", 10), ("1.0", 90))).status_code == 200  # listed in another order
    second = versions_by_key(live, KEYS)
    assert all(second[k] == "2.0" for k in KEYS if first[k] == "2.0")
    assert abs(Counter(second.values())["2.0"] / len(KEYS) - 0.10) <= 0.02
    moved = [k for k in KEYS if first[k] != second[k]]
    assert moved and all(first[k] == "1.0" for k in moved)


def test_a_key_stays_on_its_release_while_that_release_keeps_its_share(canary: TestClient, live: httpx2.Client) -> None:
    make_release(canary, version="3.0")
    publish(canary, "gguf-q8", {"model.gguf": b"3" * 50}, ["cpu"], version="3.0")
    assert post_eval(canary, "gguf-q8", "passed", version="3.0").is_success
    seal(canary, "3.0")
    keys = KEYS[:500]
    assert canary.put(SPLIT, json=weights(("1.0", 80), ("2.0", 10), ("3.0", 10))).is_success
    first = versions_by_key(live, keys)
    # 3.0 grows from 10 % to 20 %, taken from 1.0; 2.0 keeps its 10 %.
    assert canary.put(SPLIT, json=weights(("1.0", 70), ("2.0", 10), ("3.0", 20))).is_success
    second = versions_by_key(live, keys)
    on_two = [k for k in keys if first[k] == "2.0"]
    assert on_two
    assert [second[k] for k in on_two] == ["2.0"] * len(on_two)


def test_without_a_key_the_largest_member_answers_and_lists_the_split(canary: TestClient) -> None:
    assert canary.put(SPLIT, json=weights(("2.0", 5), ("1.0", 95))).status_code == 200
    answer = canary.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}).json()
    assert answer["version"] == "1.0"
    # Members keep their place: 1.0 was on the channel first, the new 2.0 follows.
    assert answer["split"] == [
        {"version": "1.0", "weight": 95.0, "chosen": True},
        {"version": "2.0", "weight": 5.0, "chosen": False},
    ]
    channel = canary.get("/v1/models/tiny/channels/prod").json()
    assert channel["version"] == "1.0"
    assert channel["split"] == [{"version": "1.0", "weight": 95.0}, {"version": "2.0", "weight": 5.0}]
    assert canary.get("/v1/models/tiny/channels").json()[0]["split"] == channel["split"]
    # A split where the newcomer is the larger: it answers without a key.
    assert canary.put(SPLIT, json=weights(("1.0", 40), ("2.0", 60))).status_code == 200
    assert canary.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"}).json()["version"] == "2.0"


def test_split_members_pass_the_promotion_gates(canary: TestClient) -> None:
    make_release(canary, version="3.0")
    publish(canary, "gguf-q8", {"model.gguf": b"3" * 50}, ["cpu"], version="3.0")
    post_eval(canary, "gguf-q8", "failed", version="3.0", reason="kl 0.4 > 0.1")
    seal(canary, "3.0")
    error = assert_error(canary.put(SPLIT, json=weights(("1.0", 95), ("3.0", 5))), 409, "EVAL_GATE_FAILED")
    assert "tiny@3.0" in error["message"] and error["details"]["failing"][0]["artifact"] == "gguf-q8"
    for reason in (None, "", "  "):
        body = {**weights(("1.0", 95), ("3.0", 5)), "force": True, "reason": reason}
        assert "reason" in assert_error(canary.put(SPLIT, json=body), 422, "INVALID_INPUT")["message"]
    assert canary.get("/v1/models/tiny/channels/prod").json()["split"] is None
    forced = {**weights(("1.0", 95), ("3.0", 5)), "force": True, "reason": "canary the fix on 5 %"}
    response = canary.put(SPLIT, json=forced)
    assert response.status_code == 200, response.text
    assert response.json()["history"][0]["forced"] is True
    audit = next(e for e in canary.get("/v1/audit", params={"model": "tiny"}).json() if e["action"] == "channel.split")
    assert audit["details"]["forced"] is True and audit["reason"] == "canary the fix on 5 %"
    assert audit["details"]["overridden_failures"][0]["artifact"] == "gguf-q8"

    make_release(canary, version="4.0")  # open
    assert_error(canary.put(SPLIT, json=weights(("1.0", 95), ("4.0", 5))), 409, "RELEASE_NOT_SEALED")
    assert_error(canary.put(SPLIT, json=weights(("1.0", 95), ("9.9", 5))), 404, "NOT_FOUND")
    assert canary.post("/v1/models/tiny/releases/3.0/yank", json={"reason": "bad"}).status_code == 200
    assert_error(canary.put(SPLIT, json=weights(("1.0", 95), ("3.0", 5))), 409, "RELEASE_YANKED")


BAD_SPLITS = [
    weights(("1.0", 95), ("2.0", 4)),  # 99 %
    weights(("1.0", 95), ("2.0", 6)),  # 101 %
    weights(("1.0", 95), ("1.0", 5)),  # listed twice
    weights(("1.0", 100), ("2.0", 0)),
    weights(("1.0", 100.5), ("2.0", -0.5)),
    weights(("1.0", 94.999), ("2.0", 5.001)),  # finer than 0.01 %
    weights(("1.0", "ninety-five"), ("2.0", 5)),
    weights(("0.0", 11.12), *((f"{i}.0", 11.11) for i in range(1, 9))),  # 9 members: more than 8
    {"weights": []},
    {"weights": [{"version": "1.0", "weight": 95}, {"version": "2.0", "weight": 5}], "canary": True},
    {"weights": [{"version": "1.0", "weight": 95, "share": 1}, {"version": "2.0", "weight": 5}]},
    {"weights": [{"version": "../1.0", "weight": 95}, {"version": "2.0", "weight": 5}]},
]


def test_bad_split_weights_are_refused(canary: TestClient) -> None:
    for body in BAD_SPLITS:
        assert_error(canary.put(SPLIT, json=body), 422, "INVALID_INPUT")
    for weight in ("NaN", "Infinity", "-Infinity"):  # not JSON numbers
        text = json.dumps(weights(("1.0", 95), ("2.0", 5))).replace("95", weight)
        assert_error(canary.put(SPLIT, content=text, headers=JSON), 422, "INVALID_JSON")
    channel = canary.get("/v1/models/tiny/channels/prod").json()
    assert channel["split"] is None and len(channel["history"]) == 1


def test_fine_weights_are_kept_to_the_hundredth(canary: TestClient) -> None:
    response = canary.put(SPLIT, json=weights(("1.0", 99.99), ("2.0", 0.01)))
    assert response.status_code == 200, response.text
    assert response.json()["split"] == [{"version": "1.0", "weight": 99.99}, {"version": "2.0", "weight": 0.01}]


def test_a_prod_split_needs_the_promote_scope(app: FastAPI, canary: TestClient) -> None:
    body = weights(("1.0", 95), ("2.0", 5))
    publisher = make_token(app, ["publish"], name="publisher")
    with TestClient(app, headers={"Authorization": f"Bearer {publisher}"}) as other:
        assert_error(other.put(SPLIT, json=body), 403, "FORBIDDEN")
        # Unprotected channels are part of publishing.
        response = other.put("/v1/models/tiny/channels/staging/split", json=body)
        assert response.status_code == 200, response.text
    reader = make_token(app, ["read"], name="reader")
    with TestClient(app, headers={"Authorization": f"Bearer {reader}"}) as other:
        assert_error(other.put("/v1/models/tiny/channels/staging/split", json=body), 403, "FORBIDDEN")
    assert_error(TestClient(app).put(SPLIT, json=body), 401, "UNAUTHORIZED")
    assert canary.get("/v1/models/tiny/channels/prod").json()["split"] is None
    promoter = make_token(app, ["promote"], name="promoter")
    with TestClient(app, headers={"Authorization": f"Bearer {promoter}"}) as other:
        response = other.put(SPLIT, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["history"][0]["actor"] == "token:promoter"


def test_a_split_is_audited_and_in_the_history(canary: TestClient) -> None:
    assert canary.put(SPLIT, json={**weights(("1.0", 95), ("2.0", 5)), "actor": "ci", "reason": "canary"}).is_success
    assert canary.put(SPLIT, json=weights(("1.0", 90), ("2.0", 10))).is_success
    history = canary.get("/v1/models/tiny/channels/prod").json()["history"]
    assert [(e["from_version"], e["to_version"], e["split"]) for e in history] == [
        ("1.0", "1.0", [{"version": "1.0", "weight": 90.0}, {"version": "2.0", "weight": 10.0}]),
        ("1.0", "1.0", [{"version": "1.0", "weight": 95.0}, {"version": "2.0", "weight": 5.0}]),
        (None, "1.0", None),
    ]
    assert (history[1]["actor"], history[1]["reason"]) == ("token:test-admin (ci)", "canary")
    audit = [e for e in canary.get("/v1/audit", params={"model": "tiny"}).json() if e["action"] == "channel.split"]
    assert len(audit) == 2 and audit[0]["target"] == "tiny/prod"
    assert audit[1]["details"]["before"] == {"version": "1.0"}
    assert audit[1]["details"]["after"] == {
        "version": "1.0",
        "split": [{"version": "1.0", "weight": 95.0}, {"version": "2.0", "weight": 5.0}],
    }
    assert audit[0]["details"]["before"] == audit[1]["details"]["after"]


def test_yanking_the_canary_takes_it_out_of_the_split(canary: TestClient, live: httpx2.Client) -> None:
    assert canary.put(SPLIT, json=weights(("1.0", 95), ("2.0", 5))).is_success
    keys = KEYS[:400]
    on_canary = [k for k, v in versions_by_key(live, keys).items() if v == "2.0"]
    assert on_canary
    assert canary.post("/v1/models/tiny/releases/2.0/yank", json={"reason": "bad tokenizer"}).status_code == 200
    channel = canary.get("/v1/models/tiny/channels/prod").json()
    assert (channel["version"], channel["split"]) == ("1.0", None)
    assert (channel["history"][0]["split"], channel["history"][0]["reason"]) == (None, "release 2.0 yanked")
    assert set(versions_by_key(live, keys).values()) == {"1.0"}
    answer = canary.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu", "key": on_canary[0]}).json()
    assert (answer["version"], answer["split"]) == ("1.0", None)
    audit = next(e for e in canary.get("/v1/audit", params={"model": "tiny"}).json() if e["action"] == "channel.split")
    assert audit["reason"] == "release 2.0 yanked" and "split" not in audit["details"]["after"]


def test_a_promotion_replaces_the_split(canary: TestClient, live: httpx2.Client) -> None:
    assert canary.put(SPLIT, json=weights(("1.0", 95), ("2.0", 5))).is_success
    assert promote(canary, "2.0").status_code == 200
    channel = canary.get("/v1/models/tiny/channels/prod").json()
    assert (channel["version"], channel["split"]) == ("2.0", None)
    assert set(versions_by_key(live, KEYS[:200]).values()) == {"2.0"}
    answer = canary.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu", "key": "k"}).json()
    assert answer["split"] is None
    audit = next(
        e for e in canary.get("/v1/audit", params={"model": "tiny"}).json() if e["action"] == "channel.promote"
    )
    assert audit["details"]["before"]["split"] == [
        {"version": "1.0", "weight": 95.0},
        {"version": "2.0", "weight": 5.0},
    ]


def test_version_answers_for_that_release_of_the_channel(app: FastAPI, canary: TestClient) -> None:
    # Without a split the channel's one release answers to its version; another release does not.
    assert canary.get("/v1/resolve", params={**CPU, "version": "1.0"}).json()["version"] == "1.0"
    for version in ("2.0", "9.9"):  # sealed but not on the channel; no such release
        error = assert_error(
            canary.get("/v1/resolve", params={**CPU, "version": version}), 404, "VERSION_NOT_IN_CHANNEL"
        )
        assert error["details"] == {"model": "tiny", "channel": "prod", "version": version, "versions": ["1.0"]}
        assert "points at 1.0 (100 %)" in error["message"]
    assert canary.put(SPLIT, json=weights(("1.0", 95), ("2.0", 5))).is_success
    answers = {v: canary.get("/v1/resolve", params={**CPU, "version": v}) for v in ("1.0", "2.0")}
    for version, response in answers.items():
        answer = response.json()
        assert answer["version"] == version
        assert answer["artifact"]["files"][0]["url"].endswith(f"/releases/{version}/artifacts/gguf-q8/files/model.gguf")
        assert [(m["version"], m["weight"], m["chosen"]) for m in answer["split"]] == [
            ("1.0", 95.0, version == "1.0"),
            ("2.0", 5.0, version == "2.0"),
        ]
    # Each release is its own cached answer, and the one without a version is the largest member's.
    assert answers["1.0"].headers["etag"] != answers["2.0"].headers["etag"]
    assert canary.get("/v1/resolve", params=CPU).headers["etag"] == answers["1.0"].headers["etag"]
    again = canary.get(
        "/v1/resolve", params={**CPU, "version": "2.0"}, headers={"If-None-Match": answers["2.0"].headers["etag"]}
    )
    assert again.status_code == 304
    # Once the channel leaves a release, naming it is refused at once (the cached answer is not served).
    assert promote(canary, "2.0").status_code == 200
    error = assert_error(canary.get("/v1/resolve", params={**CPU, "version": "1.0"}), 404, "VERSION_NOT_IN_CHANNEL")
    assert error["details"]["versions"] == ["2.0"]
    # Read access is the route's: a token for another model may not ask.
    other = make_token(app, ["read"], models=["other"], name="other-reader")
    with TestClient(app, headers={"Authorization": f"Bearer {other}"}) as stranger:
        assert_error(stranger.get("/v1/resolve", params={**CPU, "version": "2.0"}), 403, "FORBIDDEN")
    mine = make_token(app, ["read"], models=["tiny"], name="tiny-reader")
    with TestClient(app, headers={"Authorization": f"Bearer {mine}"}) as reader:
        assert reader.get("/v1/resolve", params={**CPU, "version": "2.0"}).json()["version"] == "2.0"


# --- ETags and long-polls -------------------------------------------------------------------------

CPU = {"model": "tiny", "hardware": "cpu"}


def test_an_unchanged_answer_is_304_until_a_promotion_changes_it(canary: TestClient) -> None:
    first = canary.get("/v1/resolve", params=CPU)
    etag = first.headers["etag"]
    assert etag.startswith('"') and first.headers["cache-control"] == "no-cache"
    again = canary.get("/v1/resolve", params=CPU, headers={"If-None-Match": etag})
    assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", etag)
    for tags in (f"W/{etag}", f'"other", {etag}', "*"):
        assert canary.get("/v1/resolve", params=CPU, headers={"If-None-Match": tags}).status_code == 304, tags
    assert canary.get("/v1/resolve", params=CPU, headers={"If-None-Match": '"other"'}).status_code == 200
    # Another query is another answer, with its own tag.
    assert canary.get("/v1/resolve", params={**CPU, "context": 8192}).headers["etag"] != etag
    assert promote(canary, "2.0").status_code == 200
    moved = canary.get("/v1/resolve", params=CPU, headers={"If-None-Match": etag})
    assert moved.status_code == 200 and moved.json()["version"] == "2.0"
    assert moved.headers["etag"] != etag


def test_a_long_poll_answers_when_a_promotion_lands(canary: TestClient, live: httpx2.Client) -> None:
    etag = live.get("/v1/resolve", params=CPU).headers["etag"]
    answers: list[tuple[httpx2.Response, float]] = []

    def poll() -> None:
        started = time.monotonic()
        response = live.get("/v1/resolve", params={**CPU, "wait": 5}, headers={"If-None-Match": etag})
        answers.append((response, time.monotonic() - started))

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    assert poller.is_alive()  # held: nothing changed yet
    assert promote(canary, "2.0").status_code == 200
    poller.join(timeout=10)
    (response, elapsed), *_ = answers
    assert response.status_code == 200 and response.json()["version"] == "2.0"
    assert response.headers["etag"] != etag
    assert elapsed < 4, elapsed  # it answered on the change, not at the deadline


def test_a_long_poll_with_nothing_changed_is_304_after_the_wait(live: httpx2.Client) -> None:
    etag = live.get("/v1/resolve", params=CPU).headers["etag"]
    started = time.monotonic()
    response = live.get("/v1/resolve", params={**CPU, "wait": 1}, headers={"If-None-Match": etag})
    elapsed = time.monotonic() - started
    assert (response.status_code, response.headers["etag"]) == (304, etag)
    assert 0.9 <= elapsed < 3, elapsed
    # Without If-None-Match, or with a tag that is not current, wait does not hold the request.
    for headers in ({}, {"If-None-Match": '"stale"'}):
        started = time.monotonic()
        response = live.get("/v1/resolve", params={**CPU, "wait": 5}, headers=headers)
        assert (response.status_code, response.headers["etag"]) == (200, etag)
        assert time.monotonic() - started < 1


# --- hostile query values -------------------------------------------------------------------------


HOSTILE_QUERIES: list[tuple[dict[str, Any], str, str]] = [  # (query, code, what the message says)
    (
        {"hardware": ",".join(f"pool{i}" for i in range(17))},
        "RESOLVE_POOLS_INVALID",
        "at most 16 hardware pools per query",
    ),
    ({"hardware": "h100,mi300x,h100"}, "RESOLVE_POOLS_INVALID", "hardware 'h100' is listed twice"),
    ({"hardware": "h100:4,h100:2"}, "RESOLVE_POOLS_INVALID", "hardware 'h100' is listed twice"),
    ({"hardware": "h100:-1"}, "RESOLVE_POOLS_INVALID", "free devices must be a whole number"),
    ({"hardware": "h100:abc"}, "RESOLVE_POOLS_INVALID", "free devices must be a whole number"),
    ({"hardware": "h100:1.5"}, "RESOLVE_POOLS_INVALID", "free devices must be a whole number"),
    ({"hardware": "h100:99999999"}, "RESOLVE_POOLS_INVALID", "free devices must be a whole number"),
    ({"hardware": "h100:٣"}, "RESOLVE_POOLS_INVALID", "free devices must be a whole number"),  # an Arabic-Indic digit
    ({"hardware": "h100:"}, "RESOLVE_POOLS_INVALID", "free devices must be a whole number"),
    ({"hardware": "h１００"}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),  # full-width digits
    ({"hardware": "ｈ100"}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),
    ({"hardware": "h100\u0000"}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),
    ({"hardware": "h100,,mi300x"}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),
    ({"hardware": ""}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),
    ({"hardware": "H100"}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),
    ({"hardware": "h" * 33}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),
    ({"hardware": "🔥"}, "RESOLVE_POOLS_INVALID", "expected an SKU name"),
    ({"hardware": "h100," * 400}, "INVALID_INPUT", "query.hardware:"),  # 2,000 characters
    ({"hardware": "h" * 2000}, "INVALID_INPUT", "query.hardware:"),
    ({"hardware": "pool9"}, "UNKNOWN_NAME", "unknown hardware 'pool9'; known: a100"),
    ({"model": "l" * 2000}, "INVALID_INPUT", "query.model:"),
    ({"model": "llamä"}, "INVALID_INPUT", "query.model:"),
    ({"channel": "p" * 2000}, "INVALID_INPUT", "query.channel:"),
    ({"channel": "prod\n"}, "INVALID_INPUT", "query.channel:"),
    ({"key": "k" * 300}, "INVALID_INPUT", "query.key:"),
    ({"key": ""}, "INVALID_INPUT", "query.key:"),
    ({"version": "v" * 65}, "INVALID_INPUT", "query.version:"),
    ({"version": "../1.0"}, "INVALID_INPUT", "query.version:"),
    ({"version": "1.0", "key": "k"}, "RESOLVE_KEY_AND_VERSION", "not both"),
    ({"policy": "fastest"}, "INVALID_INPUT", "query.policy:"),
    ({"kv_cache_dtype": "int4"}, "INVALID_INPUT", "query.kv_cache_dtype:"),
    ({"context": 0}, "INVALID_INPUT", "query.context:"),
    ({"context": 10**12}, "INVALID_INPUT", "query.context:"),
    ({"context": "4k"}, "INVALID_INPUT", "query.context:"),
    ({"concurrency": -1}, "INVALID_INPUT", "query.concurrency:"),
    ({"min_tokens_per_s": "nan"}, "INVALID_INPUT", "query.min_tokens_per_s:"),
    ({"min_tokens_per_s": "inf"}, "INVALID_INPUT", "query.min_tokens_per_s:"),
    ({"max_ttft_ms": 0}, "INVALID_INPUT", "query.max_ttft_ms:"),
    ({"max_ttft_ms": "1e400"}, "INVALID_INPUT", "query.max_ttft_ms:"),
    ({"wait": 61}, "INVALID_INPUT", "query.wait:"),
    ({"wait": -1}, "INVALID_INPUT", "query.wait:"),
]


def test_hostile_query_values_are_422_never_500(fleet: TestClient) -> None:
    for params, code, said in HOSTILE_QUERIES:
        error = assert_error(resolve(fleet, **params), 422, code)
        assert said in error["message"] and len(error["message"]) < 1000, (params, error["message"][:300])


def test_extreme_but_valid_values_are_answered(fleet: TestClient) -> None:
    # A 10M-token context for 100,000 sequences fits nowhere: a 404 that says so, not an overflow.
    error = assert_error(resolve(fleet, context=10_000_000, concurrency=100_000), 404, "NO_COMPATIBLE_ARTIFACT")
    assert "context 10000000 × concurrency 100000" in error["message"]
    assert resolve(fleet, hardware="h100:9999999,mi300x:0").json()["hardware"] == "h100"
    # Pools its artifacts do not run on add no candidates, and no error.
    assert ranking(resolve(fleet, hardware="tpu-v5e,a100,h100,cpu,mi300x,tpu-v5p").json())[0] == (
        "h100",
        "hf-fp8",
        2,
        True,
    )
    many = ",".join(["h100", "h200", "b200", "a100", "l40s", "mi300x", "mi325x", "mi355x", "tpu-v5e", "tpu-v5p"])
    answer = resolve(fleet, hardware=many + ",cpu,edge,apple-m2").json()
    # h200 and mi325x run what h100 and mi300x run (the same architectures); b200 (sm100) does not.
    assert {c["hardware"] for c in [answer, *answer["fallbacks"]]} == {"h100", "h200", "mi300x", "mi325x"}
    assert resolve(fleet, key="ключ-🔑" * 20).status_code == 200
    assert resolve(fleet, min_tokens_per_s=0.001, max_ttft_ms=86_400_000).status_code == 200  # the range's ends
    assert_error(resolve(fleet, min_tokens_per_s=1e-300), 422, "INVALID_INPUT")  # below a token in 1,000 s


def test_query_strings_that_are_not_utf_8_are_422_or_ignored(canary: TestClient) -> None:
    for query in ("hardware=%ED%A0%80", "hardware=%FF", "hardware=cpu%00", "model=%FF&hardware=cpu", "hardware=%"):
        response = canary.get(f"/v1/resolve?model=tiny&{query}")
        assert response.status_code == 422, (query, response.text)
    assert canary.put(SPLIT, json=weights(("1.0", 95), ("2.0", 5))).is_success
    for key in ("%ED%A0%80", "%FF%FE", "%00", "a%2Cb"):
        response = canary.get(f"/v1/resolve?model=tiny&hardware=cpu&key={key}")
        assert response.status_code == 200, (key, response.text)
