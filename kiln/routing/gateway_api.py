"""`--format gateway-api`: the Gateway API Inference Extension's objects for a channel, for the gateways that
implement it (llm-d, kgateway, Envoy AI Gateway, GKE).

Per hardware pool:

- an `InferencePool` (`inference.networking.k8s.io/v1`) selecting the pool's model servers by the labels
  `kiln.dev/model`, `kiln.dev/channel` and `kiln.dev/hardware`, on `target_port`, with its endpoint picker;
- an `InferenceModelRewrite` (`inference.networking.x-k8s.io/v1alpha2`) whose one rule matches requests
  for the model by name and sends them to each release's served name, `<model>@<version>`, with the split's
  weights in basis points (9500 and 500 for 95 % and 5 %: a weight is relative, an integer from 1);
- with `priority`, an `InferenceObjective` (same API) giving the pool's requests that priority.

Traffic between pools stays with the gateway's HTTPRoute (the rewrite's own proposal leaves it there); the
rewrite splits releases within a pool, so each release's model servers in a pool serve its own name
(vLLM `--served-model-name <model>@<version>`) and carry the pool's labels. Every object is annotated
with what kiln resolved for the pool (`kiln.routing.annotations`): each release's artifact, manifest
digest, TP and runtime, and resolve's reason.

Sources: InferencePool v1 at kubernetes-sigs/gateway-api-inference-extension v1.6.0; InferenceObjective and
InferenceModelRewrite, which left that repository in its commit 88fd4792 ("Remove inference objective,
model rewrite and endpoint picker config APIs"), at llm-d/llm-d-inference-scheduler main 520af478 (its
releases up to v0.8.0 do not carry them yet); `apix/v1alpha2/inferencemodelrewrite_types.go` for the
weights' meaning. The CRDs themselves are in tests/kiln/routing/crds/.
"""

from __future__ import annotations

from kiln.routing.annotations import pool_annotations
from kiln.routing.formats import ApiSource, Document, RouterFormat, register
from kiln.routing.names import (
    CHANNEL_LABEL,
    HARDWARE_LABEL,
    MANAGED_BY,
    MODEL_LABEL,
    dns_label,
    label_value,
)
from kiln.routing.records import ChannelRouting, PoolRouting, RenderOptions

POOL_API = "inference.networking.k8s.io/v1"
EXTENSION_API = "inference.networking.x-k8s.io/v1alpha2"
APIS = (
    ApiSource(
        POOL_API,
        ("InferencePool",),
        "kubernetes-sigs/gateway-api-inference-extension",
        "v1.6.0",
        "992e5c292afb248801ce8d9234eb5b9d28eea231",
        "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
    ),
    ApiSource(
        EXTENSION_API,
        ("InferenceObjective", "InferenceModelRewrite"),
        "llm-d/llm-d-inference-scheduler",
        "main",
        "520af47896e5f06e43d09aca281a1149187b0ffd",
        "config/crd/bases/inference.networking.x-k8s.io_{inferenceobjectives,inferencemodelrewrites}.yaml",
    ),
)


def served_name(model: str, version: str) -> str:
    """The name a release's model servers answer to, which the rewrite sends requests to."""
    return f"{model}@{version}"


def pool_name(routing: ChannelRouting, pool: PoolRouting) -> str:
    return dns_label(routing.model, routing.channel, pool.hardware)


def selector(routing: ChannelRouting, pool: PoolRouting) -> dict[str, str]:
    """The labels the pool's model servers carry (every release's)."""
    return {
        MODEL_LABEL: label_value(routing.model),
        CHANNEL_LABEL: label_value(routing.channel),
        HARDWARE_LABEL: label_value(pool.hardware),
    }


def render(routing: ChannelRouting, options: RenderOptions) -> list[Document]:
    """An InferencePool, an InferenceModelRewrite and (with a priority) an InferenceObjective per pool."""
    documents: list[Document] = []
    for pool in routing.pools:
        name = pool_name(routing, pool)
        labels = selector(routing, pool)
        metadata = {
            "name": name,
            "namespace": options.namespace,
            "labels": {**MANAGED_BY, **labels},
            "annotations": pool_annotations(routing, pool),
        }
        pool_ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}
        documents.append(
            {
                "apiVersion": POOL_API,
                "kind": "InferencePool",
                "metadata": metadata,
                "spec": {
                    "selector": {"matchLabels": labels},
                    "targetPorts": [{"number": options.target_port}],
                    "endpointPickerRef": {
                        "name": options.endpoint_picker or dns_label(name, "epp"),
                        "port": {"number": options.endpoint_picker_port},
                    },
                },
            }
        )
        if options.priority is not None:
            documents.append(
                {
                    "apiVersion": EXTENSION_API,
                    "kind": "InferenceObjective",
                    "metadata": metadata,
                    "spec": {"poolRef": pool_ref, "priority": options.priority},
                }
            )
        documents.append(
            {
                "apiVersion": EXTENSION_API,
                "kind": "InferenceModelRewrite",
                "metadata": metadata,
                "spec": {
                    "poolRef": pool_ref,
                    "rules": [
                        {
                            "matches": [{"model": {"type": "Exact", "value": routing.model}}],
                            "targets": [
                                {"modelRewrite": served_name(routing.model, p.version), "weight": p.weight}
                                for p in pool.placements
                            ],
                        }
                    ],
                },
            }
        )
    return documents


FORMAT = register(
    RouterFormat(
        "gateway-api",
        "the Gateway API Inference Extension (llm-d, kgateway, Envoy AI Gateway)",
        APIS,
        render,
    )
)
