"""`--format kserve`: KServe InferenceServices that pull kiln's model cars, and InferenceGraphs for splits.

Per hardware pool, one `InferenceService` (`serving.kserve.io/v1beta1`) per release of the channel:

- `storageUri: oci://<registry>/modelcar/<model>:<version>-<artifact>`, the model car of the artifact
  resolve chose for the pool (docs/oci.md): the version's tag, so a promotion is a new object, never a
  tag moving under a running one;
- the runtime the artifact needs (`kiln.routing.runtimes`: vLLM for hf-bundle and rocm-bundle, llama.cpp
  for GGUF, TensorRT-LLM for trtllm checkpoints and engines), named as its ServingRuntime, with the flags
  that size it as resolve did (TP, context, concurrency) and serve it under the model's name;
- the replica's devices, `reason.tp` of the family's resource (nvidia.com/gpu, amd.com/gpu,
  google.com/tpu; none for CPUs), on nodes labelled `kiln.dev/hardware: <sku>`.

A channel of one release is one InferenceService per pool, named `<model>-<channel>-<hardware>`. A split
is one per release (`...-<version>`) and an `InferenceGraph` (`serving.kserve.io/v1alpha1`) of that first
name whose root `Splitter` sends each request to a release's predictor with the split's weight: declarative
(the objects say the weights; applying them again changes nothing), where `canaryTrafficPercent` moves
traffic between a service's previous and latest revision (state the objects do not hold, two releases at
most, Serverless mode only), and `spec.canary` (v0.20, Standard mode only) splits by replica counts
(`canaryReplicaCount`), which a few replicas cannot make 95/5. KServe's own admission check wants a
Splitter's weights whole percents summing to 100 (`inference_graph_validation.go`), so a split finer than
that is refused here (ROUTING_SPLIT_NOT_WHOLE_PERCENT). KServe's graph router posts the request body to
each step's URL and answers with the whole response, so the steps name the predictors' OpenAI chat
completions endpoint; streamed answers need the Gateway API format.

Sources: kserve/kserve v0.20.0 (1fb78105): config/crd/full/serving.kserve.io_{inferenceservices,
inferencegraphs}.yaml, pkg/apis/serving/v1alpha1/inference_graph{,_validation}.go, cmd/router/main.go,
pkg/apis/serving/v1beta1/inference_service{,_validation}.go, config/runtimes/kserve-vllmserver.yaml.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.registry.channels.buckets import BASIS_POINTS
from kiln.registry.oci.media_types import TAG
from kiln.routing.annotations import placement_annotations, pool_annotations
from kiln.routing.formats import ApiSource, Document, RouterFormat, register
from kiln.routing.names import (
    CHANNEL_LABEL,
    HARDWARE_LABEL,
    MANAGED_BY,
    MODEL_LABEL,
    RELEASE_LABEL,
    dns_label,
    label_value,
    unique,
    version_slug,
)
from kiln.routing.records import ChannelRouting, Placement, PoolRouting, RenderOptions
from kiln.routing.runtimes import RUNTIMES, device_resource

SERVICE_API = "serving.kserve.io/v1beta1"
GRAPH_API = "serving.kserve.io/v1alpha1"
_KSERVE = ("kserve/kserve", "v0.20.0", "1fb781055dd1567164358233e1125142ca6ef1fe")
APIS = (
    ApiSource(SERVICE_API, ("InferenceService",), *_KSERVE, "config/crd/full/serving.kserve.io_inferenceservices.yaml"),
    ApiSource(GRAPH_API, ("InferenceGraph",), *_KSERVE, "config/crd/full/serving.kserve.io_inferencegraphs.yaml"),
)
# KServe names: DNS-1035 labels (its admission checks). Kept to 45 characters: KServe and Knative add
# suffixes (-predictor, a revision number) to make the names of the objects behind a service.
MAX_NAME = 45
OPENAI_PATH = "/v1/chat/completions"
MODELCAR_REPOSITORY = "modelcar/{model}"


def modelcar_tag(version: str, artifact: str) -> str:
    """The registry's tag for a release's artifact (registry.oci.service.tag); refused where OCI has none."""
    tag = f"{version}-{artifact}"
    if not TAG.fullmatch(tag):
        raise InvalidInput(
            f"release {version} has no OCI tag for {artifact} ({tag[:60]!r} breaks the tag grammar: a '+' "
            "or more than 128 characters), so no model car to name; KServe cannot pull it by tag",
            code=Codes.ROUTING_MODELCAR_TAG_INVALID,
            details={"version": version, "artifact": artifact},
        )
    return tag


def modelcar_uri(routing: ChannelRouting, placement: Placement, options: RenderOptions) -> str:
    host = options.oci_host or urlsplit(routing.registry).netloc
    repository = MODELCAR_REPOSITORY.format(model=routing.model)
    return f"oci://{host}/{repository}:{modelcar_tag(placement.version, placement.artifact.name)}"


def _labels(routing: ChannelRouting, pool: PoolRouting, version: str | None = None) -> dict[str, str]:
    labels = {
        **MANAGED_BY,
        MODEL_LABEL: label_value(routing.model),
        CHANNEL_LABEL: label_value(routing.channel),
        HARDWARE_LABEL: label_value(pool.hardware),
    }
    if version is not None:
        labels[RELEASE_LABEL] = label_value(version)
    return labels


def _service(
    name: str, routing: ChannelRouting, pool: PoolRouting, placement: Placement, options: RenderOptions
) -> Document:
    runtime = RUNTIMES[placement.runtime]
    if runtime.kserve_runtime is None or runtime.kserve_model_format is None:
        raise InvalidInput(
            f"{placement.artifact.name} of {routing.model}@{placement.version} on {pool.hardware} is served by "
            f"{runtime.name} ({runtime.serves}), which KServe has no runtime for",
            code=Codes.ROUTING_RUNTIME_UNSUPPORTED,
            details={"artifact": placement.artifact.name, "runtime": runtime.name, "hardware": pool.hardware},
        )
    resource = device_resource(pool.hardware, pool.family)
    sizing = routing.sizing
    model: Document = {
        "modelFormat": {"name": runtime.kserve_model_format},
        "runtime": runtime.kserve_runtime,
        "storageUri": modelcar_uri(routing, placement, options),
    }
    args = runtime.sized_args(routing.model, placement.tp, sizing.context, sizing.concurrency)
    if args:
        model["args"] = args
    if resource is not None:
        count = str(placement.tp)
        model["resources"] = {"requests": {resource: count}, "limits": {resource: count}}
    return {
        "apiVersion": SERVICE_API,
        "kind": "InferenceService",
        "metadata": {
            "name": name,
            "namespace": options.namespace,
            "labels": _labels(routing, pool, placement.version),
            "annotations": placement_annotations(routing, placement),
        },
        "spec": {"predictor": {"nodeSelector": {HARDWARE_LABEL: label_value(pool.hardware)}, "model": model}},
    }


def whole_percent(routing: ChannelRouting, pool: PoolRouting, placement: Placement) -> int:
    if placement.weight % (BASIS_POINTS // 100):
        split = ", ".join(f"{p.version} {p.percent:g} %" for p in pool.placements)
        raise InvalidInput(
            f"KServe's Splitter takes whole percents summing to 100; the split of {routing.model} "
            f"channel {routing.channel} is {split}",
            code=Codes.ROUTING_SPLIT_NOT_WHOLE_PERCENT,
            details={"split": [{"version": p.version, "weight": p.percent} for p in pool.placements]},
        )
    return placement.weight // (BASIS_POINTS // 100)


def render(routing: ChannelRouting, options: RenderOptions) -> list[Document]:
    """InferenceServices per pool and release, with an InferenceGraph per pool where the channel is split."""
    documents: list[Document] = []
    for pool in routing.pools:
        base = dns_label(routing.model, routing.channel, pool.hardware, max_length=MAX_NAME)
        if len(pool.placements) == 1:
            documents.append(_service(base, routing, pool, pool.placements[0], options))
            continue
        versions = [p.version for p in pool.placements]
        slugs = unique([version_slug(v) for v in versions], versions)
        names = unique(
            [dns_label(routing.model, routing.channel, pool.hardware, s, max_length=MAX_NAME) for s in slugs],
            versions,
            MAX_NAME,
        )
        services = [_service(n, routing, pool, p, options) for n, p in zip(names, pool.placements, strict=True)]
        documents.extend(services)
        steps = [
            {
                "name": slug,
                "serviceUrl": f"http://{name}-predictor.{options.namespace}.svc.cluster.local{OPENAI_PATH}",
                "weight": whole_percent(routing, pool, p),
            }
            for slug, name, p in zip(slugs, names, pool.placements, strict=True)
        ]
        documents.append(
            {
                "apiVersion": GRAPH_API,
                "kind": "InferenceGraph",
                "metadata": {
                    "name": base,
                    "namespace": options.namespace,
                    "labels": _labels(routing, pool),
                    "annotations": pool_annotations(routing, pool),
                },
                "spec": {"nodes": {"root": {"routerType": "Splitter", "steps": steps}}},
            }
        )
    return documents


FORMAT = register(RouterFormat("kserve", "KServe", APIS, render, needs_modelcars=True))
