"""`kiln routing render` against a registry (SQLite and PostgreSQL): every release of the channel on every pool,
each document valid for its CRD, exactly the weights changed by a split change, and a code for each bad input."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.client import RegistryClient
from kiln.core.errors import KilnError
from kiln.core.resolve import ResolveOut
from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from kiln.routing import Rendered, RenderOptions, Sizing, render_channel
from tests.kiln.routing.conftest import MODEL
from tests.kiln.routing.kube_schema import assert_valid

POOLS = ["h100:8", "mi300x:8"]
# 32K × 64 sequences of an 8B-like shape: a 256 GiB KV cache, TP 4 on H100s (72 GiB usable each), 2 on MI300Xs.
SIZING = Sizing(context=32768, concurrency=64)


def split(client: TestClient, **weights: float) -> None:
    body = {"weights": [{"version": v, "weight": w} for v, w in weights.items()]}
    response = client.put(f"/v1/models/{MODEL}/channels/prod/split", json=body)
    assert response.status_code == 200, response.text


def render(client: TestClient, fmt: str, pools: list[str] = POOLS, **options: Any) -> Rendered:
    registry = RegistryClient(client, "test")  # type: ignore[arg-type]  # the app's TestClient is an httpx2 client
    sizing = options.pop("sizing", SIZING)
    rendered = render_channel(
        registry, MODEL, options.pop("channel", "prod"), fmt, pools, sizing, RenderOptions(**options)
    )
    for document in rendered.documents:
        assert_valid(document)
    return rendered


def refused(action: Callable[[], object], code: str) -> KilnError:
    with pytest.raises(KilnError) as caught:
        action()
    assert caught.value.code == code, caught.value.to_dict()
    return caught.value


def by_kind(rendered: Rendered, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in rendered.documents if d["kind"] == kind}


def manifest_digest(client: TestClient, version: str, artifact: str) -> str:
    digest: str = client.get(f"/v1/models/{MODEL}/releases/{version}/artifacts/{artifact}").json()["manifest_digest"]
    return digest


def test_gateway_api_places_every_release_on_every_pool(fleet: TestClient) -> None:
    split(fleet, **{"1.4.0": 95, "1.5.0": 5})
    rendered = render(fleet, "gateway-api", priority=10)
    assert [(d["kind"], d["metadata"]["name"]) for d in rendered.documents] == [
        (kind, f"llama-prod-{hw}")
        for hw in ("h100", "mi300x")
        for kind in ("InferencePool", "InferenceObjective", "InferenceModelRewrite")
    ]
    for hw, artifact, tp, runtime in (
        ("h100", "hf-bundle-fp8", 4, "vllm"),
        ("mi300x", "rocm-bundle-bf16", 2, "vllm-rocm"),
    ):
        pool = by_kind(rendered, "InferencePool")[f"llama-prod-{hw}"]
        labels = {"kiln.dev/model": "llama", "kiln.dev/channel": "prod", "kiln.dev/hardware": hw}
        assert pool["spec"]["selector"] == {"matchLabels": labels}
        assert pool["spec"]["endpointPickerRef"] == {"name": f"llama-prod-{hw}-epp", "port": {"number": 9002}}
        for version in ("1.4.0", "1.5.0"):
            for doc in rendered.documents:
                if doc["metadata"]["name"] == f"llama-prod-{hw}":
                    said = doc["metadata"]["annotations"]
                    assert said[f"kiln.dev/release.{version}"] == (
                        f"{artifact} ({artifact.split('-')[0]}-bundle, safetensors, {artifact.split('-')[-1]}), "
                        f"TP {tp}, {runtime}, manifest {manifest_digest(fleet, version, artifact)}"
                    )
                    assert said[f"kiln.dev/why.{version}"].startswith(f"{artifact} on {hw}: TP {tp} of 8")
        rewrite = by_kind(rendered, "InferenceModelRewrite")[f"llama-prod-{hw}"]["spec"]
        assert rewrite == {
            "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": f"llama-prod-{hw}"},
            "rules": [
                {
                    "matches": [{"model": {"type": "Exact", "value": "llama"}}],
                    "targets": [
                        {"modelRewrite": "llama@1.4.0", "weight": 9500},
                        {"modelRewrite": "llama@1.5.0", "weight": 500},
                    ],
                }
            ],
        }
        assert by_kind(rendered, "InferenceObjective")[f"llama-prod-{hw}"]["spec"]["priority"] == 10
    assert rendered.text.startswith("# Rendered by `kiln routing render --format gateway-api`")
    assert "kubernetes-sigs/gateway-api-inference-extension v1.6.0 (992e5c29)" in rendered.text
    assert "llm-d/llm-d-inference-scheduler main (520af478)" in rendered.text


def test_kserve_serves_each_release_from_its_model_car_behind_a_splitter(fleet: TestClient) -> None:
    split(fleet, **{"1.4.0": 95, "1.5.0": 5})
    rendered = render(fleet, "kserve")
    services, graphs = by_kind(rendered, "InferenceService"), by_kind(rendered, "InferenceGraph")
    assert sorted(graphs) == ["llama-prod-h100", "llama-prod-mi300x"]
    for hw, artifact, tp, resource, runtime in (
        ("h100", "hf-bundle-fp8", 4, "nvidia.com/gpu", "kserve-vllmserver"),
        ("mi300x", "rocm-bundle-bf16", 2, "amd.com/gpu", "kiln-vllm-rocm"),
    ):
        for version in ("1.4.0", "1.5.0"):
            service = services[f"llama-prod-{hw}-{version.replace('.', '-')}"]
            assert service["metadata"]["labels"]["kiln.dev/release"] == version
            said = service["metadata"]["annotations"]
            assert (said["kiln.dev/release"], said["kiln.dev/tp"]) == (version, str(tp))
            assert said["kiln.dev/manifest-digest"] == manifest_digest(fleet, version, artifact)
            predictor = service["spec"]["predictor"]
            assert predictor["nodeSelector"] == {"kiln.dev/hardware": hw}
            model = predictor["model"]
            tag = f"{version}-{artifact}"
            assert model["storageUri"] == f"oci://testserver/modelcar/llama:{tag}"
            assert (model["modelFormat"], model["runtime"]) == ({"name": "vLLM"}, runtime)
            assert model["args"] == [
                "--served-model-name=llama",
                f"--tensor-parallel-size={tp}",
                "--max-model-len=32768",
                "--max-num-seqs=64",
            ]
            assert model["resources"] == {"requests": {resource: str(tp)}, "limits": {resource: str(tp)}}
            # The URI names a model car the registry serves.
            car = fleet.get(f"/v2/modelcar/llama/manifests/{tag}")
            assert car.status_code == 200, car.text[:300]
        steps = graphs[f"llama-prod-{hw}"]["spec"]["nodes"]["root"]
        assert steps == {
            "routerType": "Splitter",
            "steps": [
                {
                    "name": "1-4-0",
                    "serviceUrl": f"http://llama-prod-{hw}-1-4-0-predictor.default.svc.cluster.local/v1/chat/completions",
                    "weight": 95,
                },
                {
                    "name": "1-5-0",
                    "serviceUrl": f"http://llama-prod-{hw}-1-5-0-predictor.default.svc.cluster.local/v1/chat/completions",
                    "weight": 5,
                },
            ],
        }
    assert "kserve/kserve v0.20.0 (1fb78105)" in rendered.text


def changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    diff = list(difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0))
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    return removed, added


def test_a_split_change_renders_again_with_only_the_weights_changed(fleet: TestClient) -> None:
    split(fleet, **{"1.4.0": 95, "1.5.0": 5})
    before = {fmt: render(fleet, fmt).text for fmt in ("gateway-api", "kserve")}
    assert {fmt: render(fleet, fmt).text for fmt in before} == before  # the same channel renders the same bytes
    split(fleet, **{"1.4.0": 90, "1.5.0": 10})
    after = {fmt: render(fleet, fmt).text for fmt in before}
    # One InferenceModelRewrite per pool (weights in basis points), one Splitter per pool (in percent).
    assert changed_lines(before["gateway-api"], after["gateway-api"]) == (
        ["      weight: 9500", "      weight: 500"] * 2,
        ["      weight: 9000", "      weight: 1000"] * 2,
    )
    assert changed_lines(before["kserve"], after["kserve"]) == (
        ["        weight: 95", "        weight: 5"] * 2,
        ["        weight: 90", "        weight: 10"] * 2,
    )


def test_a_channel_of_one_release_renders_without_a_split(fleet: TestClient) -> None:
    pools = ["h100:8", "cpu", "b200:8"]
    sizing = Sizing(context=4096, concurrency=4)
    rewrites = by_kind(render(fleet, "gateway-api", pools, sizing=sizing), "InferenceModelRewrite")
    assert [r["spec"]["rules"][0]["targets"] for r in rewrites.values()] == [
        [{"modelRewrite": "llama@1.4.0", "weight": 10000}]
    ] * 3
    rendered = render(fleet, "kserve", pools, sizing=sizing, namespace="serving", oci_host="registry.kiln:8000")
    assert [(d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in rendered.documents] == [
        ("InferenceService", f"llama-prod-{hw}", "serving") for hw in ("h100", "cpu", "b200")
    ]
    h100, cpu, b200 = (d["spec"]["predictor"]["model"] for d in rendered.documents)
    assert h100["storageUri"] == "oci://registry.kiln:8000/modelcar/llama:1.4.0-hf-bundle-fp8"
    assert h100["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    # GGUF on CPUs: llama.cpp's server, its context shared by its parallel slots, no device to request.
    assert (cpu["runtime"], cpu["modelFormat"]) == ("kiln-llama-cpp", {"name": "gguf"})
    assert cpu["args"] == ["--alias=llama", "--ctx-size=16384", "--parallel=4"] and "resources" not in cpu
    # A TensorRT engine: its own runtime, built for one GPU.
    assert (b200["runtime"], b200["resources"]["limits"]) == ("kiln-tensorrt-llm-engine", {"nvidia.com/gpu": "1"})
    assert "args" not in b200


class SplitDuringRead(RegistryClient):
    """A client whose first resolve is followed, once, by another change of the split (as if a release
    manager changed it while the render read the channel)."""

    def __init__(self, client: TestClient, change: Callable[[], None]) -> None:
        super().__init__(client, "test")  # type: ignore[arg-type]
        self._change: Callable[[], None] | None = change
        self.versions: list[str | None] = []

    def resolve(self, *args: Any, **kwargs: Any) -> ResolveOut:
        answer = super().resolve(*args, **kwargs)
        self.versions.append(kwargs.get("version"))
        if self._change is not None:
            self._change, change = None, self._change
            change()
        return answer


def test_a_split_changed_while_it_is_read_is_read_again(fleet: TestClient) -> None:
    split(fleet, **{"1.4.0": 95, "1.5.0": 5})
    reader = SplitDuringRead(fleet, lambda: split(fleet, **{"1.4.0": 50, "1.5.0": 50}))
    rendered = render_channel(reader, MODEL, "prod", "gateway-api", POOLS, SIZING)
    assert rendered.routing.split == (("1.4.0", 5000), ("1.5.0", 5000))
    assert reader.versions.count(None) == 2  # the split was read twice
    reader = SplitDuringRead(fleet, lambda: split(fleet, **{"1.5.0": 100}))
    rendered = render_channel(reader, MODEL, "prod", "gateway-api", POOLS, SIZING)
    assert rendered.routing.split == (("1.5.0", 10000),)


def test_bad_input_is_refused_with_a_code(fleet: TestClient, settings: RegistrySettings) -> None:
    refused(lambda: render(fleet, "istio"), "ROUTING_FORMAT_UNKNOWN")
    assert "known: gateway-api, kserve" in refused(lambda: render(fleet, "kserve-v2"), "ROUTING_FORMAT_UNKNOWN").message
    refused(lambda: render(fleet, "kserve", []), "ROUTING_NO_POOLS")
    for pools in (["h100,mi300x"], ["h100:x"], ["h100", "h100:2"], ["H100"]):
        refused(lambda pools=pools: render(fleet, "gateway-api", pools), "ROUTING_POOL_INVALID")
    refused(lambda: render(fleet, "gateway-api", ["nope9"]), "UNKNOWN_NAME")
    # A pool no release of the channel has an artifact for: resolve's code, saying which pool.
    error = refused(lambda: render(fleet, "gateway-api", ["h100:8", "tpu-v5e:8"]), "NO_COMPATIBLE_ARTIFACT")
    assert error.message.startswith("pool tpu-v5e:8, release 1.4.0: release llama@1.4.0 (channel prod) has no artifact")
    refused(lambda: render(fleet, "gateway-api", ["h100:1"]), "NO_COMPATIBLE_ARTIFACT")  # TP 4 needs 4 free
    error = refused(lambda: render(fleet, "kserve", channel="staging"), "ROUTING_CHANNEL_EMPTY")
    assert "its channels: prod" in error.message and "kiln promote llama@VERSION --channel staging" in error.message
    refused(lambda: render(fleet, "kserve", namespace="Serving"), "ROUTING_OPTION_INVALID")
    refused(lambda: render(fleet, "gateway-api", target_port=0), "ROUTING_OPTION_INVALID")
    refused(lambda: Sizing.of(policy="fastest"), "ROUTING_OPTION_INVALID")
    refused(lambda: Sizing.of(context=0), "ROUTING_OPTION_INVALID")
    # What only one router cannot take: Apple GPUs have no device plugin; an engine runs at TP 1 only.
    render(fleet, "gateway-api", ["apple-m2"], sizing=Sizing())
    refused(lambda: render(fleet, "kserve", ["apple-m2"], sizing=Sizing()), "ROUTING_HARDWARE_UNSUPPORTED")
    error = refused(lambda: render(fleet, "kserve", ["b200:8"]), "ROUTING_TP_UNSUPPORTED")
    assert "runs at TP 1 only" in error.message and "needs TP 2" in error.message
    # KServe's Splitter takes whole percents; the Gateway API's weights are basis points.
    split(fleet, **{"1.4.0": 99.5, "1.5.0": 0.5})
    rewrite = by_kind(render(fleet, "gateway-api"), "InferenceModelRewrite")["llama-prod-h100"]
    assert [t["weight"] for t in rewrite["spec"]["rules"][0]["targets"]] == [9950, 50]
    error = refused(lambda: render(fleet, "kserve"), "ROUTING_SPLIT_NOT_WHOLE_PERCENT")
    assert "1.4.0 99.5 %, 1.5.0 0.5 %" in error.message


def test_kserve_needs_a_registry_that_serves_model_cars(fleet: TestClient, settings: RegistrySettings) -> None:
    plain: FastAPI = create_app(settings)  # the same database, without a model-car base image
    with TestClient(plain, headers=dict(fleet.headers)) as client:
        error = refused(lambda: render(client, "kserve"), "ROUTING_NO_MODELCARS")
        assert "KILN_REGISTRY_MODELCAR_BASE" in error.message
        render(client, "gateway-api")  # which pulls nothing
    plain.state.engine.dispose()
