"""Resolve through the HTTP API: which artifact a node should load, why, and the fallbacks."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from kiln.core.errors import NotFound
from kiln.core.hardware import builtin_catalog
from kiln.core.manifest import ArtifactIdentity
from kiln.core.shape import ShapeRecord
from kiln.registry.app import create_app
from kiln.registry.resolve.query import ResolveQuery
from kiln.registry.resolve.ranking import rank_candidates
from kiln.registry.resolve.views import ArtifactView, FileView, ReleaseView
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import LLAMA_CONFIG, assert_error, make_release, post_eval, promote, publish, seal

GIB = 1024**3
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # LLAMA_CONFIG: 128 KiB


def seed(client: TestClient, model_config: dict[str, Any] | None = None) -> None:
    make_release(client, model_config=model_config, planned=["gguf-q4", "gguf-q8", "hf-bf16", "hf-fp8"])
    publish(client, "gguf-q4", {"model.gguf": b"4" * 100}, ["cpu", "edge", "h100"], quant="q4_k_m")
    publish(client, "gguf-q8", {"model.gguf": b"8" * 200}, ["cpu", "h100"], quant="q8_0")
    publish(
        client,
        "hf-bf16",
        {"config.json": b"{}", "model.safetensors": b"b" * 398},
        ["h100", "a100"],
        quant="bf16",
        target="hf-bundle",
        format="safetensors",
    )
    publish(client, "hf-fp8", {"model.safetensors": b"f" * 150}, ["h100", "l40s"], quant="fp8", target="hf-bundle")
    post_eval(client, "gguf-q4", "passed", metrics={"kl": 0.05})
    post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.01})
    post_eval(client, "hf-bf16", "not_evaluated", reason="needs a GPU runner")
    post_eval(client, "hf-fp8", "failed", reason="kl 0.4 > 0.1")
    seal(client)
    assert promote(client, "1.0", force=True, reason="fp8 is not served").status_code == 200


def resolve(client: TestClient, **params: Any) -> Any:
    return client.get("/v1/resolve", params={"model": "tiny", **params})


def test_resolve_picks_the_best_and_ranks_fallbacks(client: TestClient) -> None:
    seed(client)
    response = resolve(client, hardware="h100")
    assert response.status_code == 200, response.text
    answer = response.json()
    assert (answer["model"], answer["channel"], answer["version"], answer["hardware"]) == (
        "tiny",
        "prod",
        "1.0",
        "h100",
    )
    # Passed before not_evaluated; among passed the smaller (faster to decode) first; failed never.
    assert answer["artifact"]["name"] == "gguf-q4"
    assert [f["artifact"]["name"] for f in answer["fallbacks"]] == ["gguf-q8", "hf-bf16"]
    artifact = answer["artifact"]
    assert artifact["quant"] == "q4_k_m" and artifact["target"] == "gguf"
    assert len(artifact["manifest_digest"]) == 64
    assert artifact["files"] == [
        {
            "path": "model.gguf",
            "sha256": artifact["files"][0]["sha256"],
            "size": 100,
            "url": "http://testserver/v1/models/tiny/releases/1.0/artifacts/gguf-q4/files/model.gguf",
        }
    ]
    assert client.get(artifact["files"][0]["url"]).content == b"4" * 100
    reason = answer["reason"]
    assert (reason["fits"], reason["tp"]) == (True, 1)
    assert reason["weights_bytes"] == 100
    assert reason["kv_cache_bytes"] == KV_PER_TOKEN * 4096
    assert reason["memory_bytes"] == 80 * GIB
    assert reason["usable_bytes"] == round(0.9 * 80 * GIB)  # the rest is left to activations and the runtime
    assert reason["required_bytes"] == 100 + KV_PER_TOKEN * 4096
    assert reason["kv_room_bytes"] == reason["usable_bytes"] - 100
    # Decode reads the weights and the whole KV cache each step, at the H100's 3350 GB/s.
    assert reason["decode_tokens_per_s_bound"] == pytest.approx(3350e9 / (100 + KV_PER_TOKEN * 4096))
    assert reason["tokens_per_s_per_sequence"] == reason["decode_tokens_per_s_bound"]
    assert reason["speed_source"] == "estimate" and reason["measured"] is None
    assert reason["eval_status"] == "passed" and reason["meets_slo"] is True
    assert "TP 1 of 8: 0.0 MiB weights + 0.5 GiB KV per device ≤ 72.0 GiB usable of 80.0 GiB" in reason["explanation"]
    assert answer["explanation"].startswith("policy latency: gguf-q4 on h100 (TP 1) is the fastest per sequence")
    bf16 = answer["fallbacks"][1]["reason"]
    assert bf16["eval_status"] == "not_evaluated" and bf16["weights_bytes"] == 400
    assert bf16["tokens_per_s_per_sequence"] < reason["tokens_per_s_per_sequence"]


def test_kv_cache_scales_with_context_and_concurrency(client: TestClient) -> None:
    seed(client)
    reason = resolve(client, hardware="cpu", context=8192, concurrency=4).json()["reason"]
    assert reason["kv_cache_bytes"] == KV_PER_TOKEN * 8192 * 4 == 4 * GIB
    assert (reason["tp"], reason["required_bytes"]) == (1, 100 + 4 * GIB)
    assert reason["usable_bytes"] == round(0.9 * 64 * GIB)
    # Four sequences share each step: the replica makes four tokens a step, each sequence one.
    assert reason["decode_tokens_per_s_bound"] == pytest.approx(4 * 50e9 / (100 + 4 * GIB))
    assert reason["tokens_per_s_per_sequence"] == pytest.approx(reason["decode_tokens_per_s_bound"] / 4)
    assert "0.0 MiB weights + 4.0 GiB KV per device ≤ 57.6 GiB usable of 64.0 GiB" in reason["explanation"]
    single = resolve(client, hardware="cpu").json()["reason"]
    assert single["kv_cache_bytes"] == KV_PER_TOKEN * 4096
    assert single["tokens_per_s_per_sequence"] > reason["tokens_per_s_per_sequence"]


def test_kl_breaks_ties(client: TestClient) -> None:
    make_release(client, planned=["a-worse", "b-better"])
    publish(client, "a-worse", {"m": b"a" * 100}, ["cpu"])
    publish(client, "b-better", {"m": b"b" * 100}, ["cpu"])
    post_eval(client, "a-worse", "passed", metrics={"kl": 0.2})
    post_eval(client, "b-better", "passed", metrics={"kl": 0.01})
    seal(client)
    promote(client)
    answer = resolve(client, hardware="cpu").json()
    assert answer["artifact"]["name"] == "b-better"
    assert [f["artifact"]["name"] for f in answer["fallbacks"]] == ["a-worse"]


def test_nothing_fits_says_why_with_numbers(client: TestClient) -> None:
    seed(client)
    # 8 GiB of KV cache alone is more than the 7.2 GiB usable (90 %) of the 8 GiB edge board.
    error = assert_error(resolve(client, hardware="edge", context=65536), 404, "NO_COMPATIBLE_ARTIFACT")
    assert "fits on edge with context 65536 × concurrency 1" in error["message"]
    assert (
        "gguf-q4 on edge needs TP 1 × 8.00 GiB (weights 100 B + KV cache 8.00 GiB per device) of 7.20 GiB usable"
        in error["message"]
    )
    assert error["details"]["memory_bytes"] == 8 * GIB
    assert error["details"]["candidates"] == [
        {"artifact": "gguf-q4", "hardware": "edge", "tp": 1, "required_bytes": 100 + KV_PER_TOKEN * 65536}
    ]
    assert resolve(client, hardware="edge", context=4096).status_code == 200


def test_no_artifact_for_hardware_lists_supported(client: TestClient) -> None:
    seed(client)
    error = assert_error(resolve(client, hardware="mi300x"), 404, "NO_COMPATIBLE_ARTIFACT")
    assert "no artifact for hardware 'mi300x'" in error["message"]
    assert "a100, cpu, edge, h100, l40s" in error["message"]
    assert error["details"]["supported_hardware"] == ["a100", "cpu", "edge", "h100", "l40s"]


def test_no_artifact_for_hardware_names_the_missing_capability(client: TestClient) -> None:
    make_release(client, planned=["gguf-q4", "hf-fp8", "hf-fp8-block"])
    sm89 = "FP8 tensor cores need sm89+ (Ada/Hopper); a100 is sm80"
    for name in ("hf-fp8", "hf-fp8-block"):
        publish(client, name, {"model.safetensors": name.encode()}, ["h100"], quant="fp8", unsupported={"a100": sm89})
    publish(client, "gguf-q4", {"model.gguf": b"4"}, ["cpu"], unsupported={"a100": "gguf runs on cpu, apple-m2, edge"})
    for name in ("gguf-q4", "hf-fp8", "hf-fp8-block"):
        post_eval(client, name, "not_evaluated", reason="not evaluated in this test")
    seal(client)
    assert promote(client, "1.0").status_code == 200
    error = assert_error(resolve(client, hardware="a100"), 404, "NO_COMPATIBLE_ARTIFACT")
    assert f"{sm89} (hf-fp8, hf-fp8-block)" in error["message"]
    assert "gguf runs on cpu, apple-m2, edge (gguf-q4)" in error["message"]
    assert error["details"]["reasons"][sm89] == ["hf-fp8", "hf-fp8-block"]
    listed = client.get("/v1/models/tiny/releases/1.0/artifacts/hf-fp8").json()
    assert listed["unsupported"] == {"a100": sm89}


def test_all_failed_for_hardware(client: TestClient) -> None:
    seed(client)
    error = assert_error(resolve(client, hardware="l40s"), 404, "NO_COMPATIBLE_ARTIFACT")
    assert "failed its eval" in error["message"] and "kl 0.4 > 0.1" in error["message"]


def test_unknown_hardware_is_422_listing_known(client: TestClient) -> None:
    seed(client)
    error = assert_error(resolve(client, hardware="tpu-v9"), 422, "UNKNOWN_NAME")
    assert "h100" in error["message"] and "mi300x" in error["message"]


def test_unknown_model_or_channel_is_404(client: TestClient) -> None:
    seed(client)
    error = assert_error(client.get("/v1/resolve", params={"model": "nope", "hardware": "cpu"}), 404, "NOT_FOUND")
    assert "model 'nope' not found" in error["message"]
    error = assert_error(resolve(client, hardware="cpu", channel="staging"), 404, "NOT_FOUND")
    assert "no channel 'staging'" in error["message"] and "prod" in error["message"]
    assert_error(resolve(client, hardware="cpu", context=0), 422, "INVALID_INPUT")
    assert_error(client.get("/v1/resolve", params={"hardware": "cpu"}), 422, "INVALID_INPUT")


def test_missing_model_config_is_explained(client: TestClient) -> None:
    seed(client, model_config={"vocab_size": 32000})
    reason = resolve(client, hardware="cpu").json()["reason"]
    assert reason["kv_cache_bytes"] == 0
    assert "lacks num_hidden_layers, num_key_value_heads, head_dim" in reason["explanation"]


def test_resolve_sees_evals_through_promotions_only(client: TestClient) -> None:
    seed(client)
    assert resolve(client, hardware="a100").json()["artifact"]["name"] == "hf-bf16"
    # An eval posted after the promotion is kept and shown, but changes nothing the channel serves...
    post_eval(client, "hf-bf16", "failed", runtime="vllm", reason="garbage output")
    assert resolve(client, hardware="a100").json()["artifact"]["name"] == "hf-bf16"
    evals = client.get("/v1/models/tiny/releases/1.0/artifacts/hf-bf16").json()["evals"]
    assert {e["runtime"]: e["status"] for e in evals} == {"llama.cpp": "not_evaluated", "vllm": "failed"}
    # ...until a new promotion (here forced, as the release now has another failure) takes it in.
    assert promote(client, "1.0", force=True, reason="take in the vllm eval").status_code == 200
    assert_error(resolve(client, hardware="a100"), 404, "NO_COMPATIBLE_ARTIFACT")
    make_release(client, version="2.0", planned=["hf-bf16"])
    publish(client, "hf-bf16", {"model.safetensors": b"c" * 50}, ["a100"], version="2.0")
    post_eval(client, "hf-bf16", "passed", version="2.0")
    seal(client, "2.0")
    promote(client, "2.0")
    answer = resolve(client, hardware="a100").json()
    assert (answer["version"], answer["artifact"]["name"]) == ("2.0", "hf-bf16")


def test_public_url_is_used_for_downloads(settings: RegistrySettings) -> None:
    app = create_app(settings.model_copy(update={"public_url": "https://registry.example/kiln/"}))
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'])}"}) as client:
        seed(client)
        url = resolve(client, hardware="cpu").json()["artifact"]["files"][0]["url"]
    assert url == "https://registry.example/kiln/v1/models/tiny/releases/1.0/artifacts/gguf-q4/files/model.gguf"


def _view(*artifacts: ArtifactView) -> ReleaseView:
    return ReleaseView("big", "1.0", ShapeRecord.from_untrusted(LLAMA_CONFIG), artifacts)


def _artifact(name: str, size: int, status: str = "passed", kl: float | None = None) -> ArtifactView:
    return ArtifactView(
        identity=ArtifactIdentity(name=name, target="hf-bundle", format="safetensors", quant="x", hardware=["h100"]),
        manifest_digest="0" * 64,
        unsupported={},
        total_size=size,
        eval_status=status,  # type: ignore[arg-type]
        kl=kl,
        failed_reasons=(),
        files=(FileView("m", "0" * 64, size),),
    )


def test_ranking_puts_what_fits_first() -> None:
    view = _view(_artifact("bf16", 140 * GIB), _artifact("int4", 38 * GIB, "not_evaluated"), _artifact("fp8", 75 * GIB))
    catalog = builtin_catalog()
    # On one H100 (72 GiB usable of 80, plus 0.5 GiB of KV cache): only int4 (38 GiB) fits, even not
    # evaluated; fp8 (75 GiB, under the 80 GiB the device has) does not.
    one = rank_candidates(view, catalog, ResolveQuery("h100:1"), "prod")
    assert [(c.artifact.identity.name, c.fits, c.plan.tp) for c in one] == [
        ("int4", True, 1),
        ("fp8", False, 1),
        ("bf16", False, 1),
    ]
    assert one[1].plan.required_per_device_bytes == 75 * GIB + KV_PER_TOKEN * 4096
    assert one[1].plan.usable_per_device_bytes == round(0.9 * 80 * GIB)
    # A whole node: fp8 and bf16 fit at TP 2, and the evaluated ones rank first, the faster first.
    node = rank_candidates(view, catalog, ResolveQuery("h100"), "prod")
    assert [(c.artifact.identity.name, c.fits, c.plan.tp) for c in node] == [
        ("fp8", True, 2),
        ("bf16", True, 2),
        ("int4", True, 1),
    ]
    assert node[1].plan.required_per_device_bytes == 70 * GIB + KV_PER_TOKEN * 4096 // 2
    # Nothing fits a pool of one device: NO_COMPATIBLE_ARTIFACT with each candidate's TP and bytes.
    with pytest.raises(NotFound) as raised:
        rank_candidates(_view(_artifact("bf16", 140 * GIB)), catalog, ResolveQuery("h100:1"), "prod")
    assert raised.value.code == "NO_COMPATIBLE_ARTIFACT"
    assert raised.value.details["candidates"] == [
        {"artifact": "bf16", "hardware": "h100", "tp": 1, "required_bytes": 140 * GIB + KV_PER_TOKEN * 4096}
    ]


def test_another_workers_promotion_is_resolved_at_once(settings: RegistrySettings) -> None:
    """Workers share only the database: what one promotes (or yanks), the other resolves on its next request."""
    first, second = create_app(settings), create_app(settings)
    token = make_token(first, ["admin"])
    headers = {"Authorization": f"Bearer {token}"}
    with TestClient(first, headers=headers) as writer, TestClient(second, headers=headers) as reader:
        seed(writer)
        assert resolve(reader, hardware="cpu").json()["version"] == "1.0"
        make_release(writer, version="2.0", planned=["gguf-q8"])
        publish(writer, "gguf-q8", {"model.gguf": b"9" * 90}, ["cpu"], version="2.0", quant="q8_0")
        post_eval(writer, "gguf-q8", "passed", version="2.0")
        seal(writer, "2.0")
        for _ in range(3):  # warm: the answer is cached until the channel moves
            assert resolve(reader, hardware="cpu").json()["version"] == "1.0"
        assert promote(writer, "2.0").status_code == 200
        assert resolve(reader, hardware="cpu").json()["version"] == "2.0"
        assert writer.post("/v1/models/tiny/releases/2.0/yank", json={"reason": "bad"}).status_code == 200
        assert_error(resolve(reader, hardware="cpu"), 410, "CHANNEL_RELEASE_YANKED")
