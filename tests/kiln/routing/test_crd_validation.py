"""The vendored CRDs are the upstream files, and validating against them refuses what an API server (or KServe's
admission webhook) would refuse: a check that cannot fail would prove nothing about the renders."""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from kiln.core.errors import KilnError
from kiln.core.manifest import ArtifactIdentity
from kiln.routing import RenderOptions
from kiln.routing.formats import get_format
from kiln.routing.records import ChannelRouting, Placement, PoolRouting, Sizing
from tests.kiln.routing.kube_schema import CRD_DIR, kinds, problems

ROW = re.compile(r"^\| (\S+\.yaml) \| (\S+) \| (\S+) \| ([0-9a-f]{40}) \| (\S+) \| ([0-9a-f]{40}) \|$")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_vendored_crds_are_the_upstream_files() -> None:
    rows = [m.groups() for line in (CRD_DIR / "SOURCES.md").read_text().splitlines() if (m := ROW.match(line))]
    assert sorted(r[0] for r in rows) == sorted(p.name for p in CRD_DIR.glob("*.yaml"))
    for name, _repository, _ref, _commit, path, blob in rows:
        assert path.endswith(name)
        assert git_blob_id((CRD_DIR / name).read_bytes()) == blob, name
    assert (CRD_DIR / "LICENSE-Apache-2.0").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for fmt in ("gateway-api", "kserve"):
        for api in get_format(fmt).apis:
            for kind in api.kinds:
                assert (api.api_version, kind) in kinds()


def placement(version: str, weight: int, **fields: Any) -> Placement:
    values: dict[str, Any] = {
        "artifact": ArtifactIdentity(
            name="hf-bundle-fp8", target="hf-bundle", format="safetensors", quant="fp8", hardware=["h100"]
        ),
        "manifest_digest": "ab" * 32,
        "tp": 2,
        "runtime": "vllm",
        "explanation": "hf-bundle-fp8 on h100: TP 2 of 8",
    }
    return Placement(version=version, weight=weight, **{**values, **fields})


ROUTING = ChannelRouting(
    model="llama-3.1-8b",
    channel="prod",
    registry="https://registry.example.com",
    sizing=Sizing(context=8192, concurrency=8),
    pools=(
        PoolRouting(
            hardware="h100",
            family="cuda",
            free_devices=8,
            placements=(placement("1.4.0", 9500), placement("1.5.0", 500)),
        ),
    ),
)


def rendered(fmt: str) -> dict[str, dict[str, Any]]:
    documents = get_format(fmt).render(ROUTING, RenderOptions(priority=5))
    return {d["kind"]: d for d in documents}


def test_pure_renders_are_valid() -> None:
    for fmt in ("gateway-api", "kserve"):
        for kind, document in rendered(fmt).items():
            assert problems(document) == [], kind


def test_the_records_hold_one_whole_split() -> None:
    with pytest.raises(ValidationError, match="10,000 basis points"):
        PoolRouting(hardware="h100", family="cuda", free_devices=None, placements=(placement("1.4.0", 9000),))
    other = PoolRouting(hardware="mi300x", family="rocm", free_devices=None, placements=(placement("1.4.0", 10000),))
    with pytest.raises(ValidationError, match="one split"):
        ChannelRouting.model_validate({**ROUTING.model_dump(), "pools": [ROUTING.pools[0], other]})


def _set(*path: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change of the document at `path` (keys and list indexes): `value` there, or the key removed (DELETE)."""

    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for p in path[:-1]:
            node = node[p]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return change


DELETE = object()
# (kind, what is broken, the change, what the refusal says)
BROKEN: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    (
        "InferencePool",
        "a misspelt field",
        _set("spec", "targetPort", value=[{"number": 8000}]),
        "'targetPort' was unexpected",
    ),
    (
        "InferencePool",
        "no target ports",
        _set("spec", "targetPorts", value=[]),
        "spec.targetPorts: [] has less than 1 item",
    ),
    (
        "InferencePool",
        "a port out of range",
        _set("spec", "targetPorts", 0, "number", value=70000),
        "70000 is greater than",
    ),
    (
        "InferencePool",
        "a port twice (CEL)",
        _set("spec", "targetPorts", value=[{"number": 8000}] * 2),
        "must be unique",
    ),
    (
        "InferencePool",
        "no picker port (CEL)",
        _set("spec", "endpointPickerRef", "port", value=DELETE),
        "port is required",
    ),
    ("InferencePool", "no selector", _set("spec", "selector", value=DELETE), '"selector" is a required property'),
    (
        "InferencePool",
        "a label value with '+'",
        _set("spec", "selector", "matchLabels", "kiln.dev/release", value="1.0+b"),
        "does not match",
    ),
    (
        "InferencePool",
        "another API version",
        _set("apiVersion", value="inference.networking.x-k8s.io/v1alpha2"),
        "no vendored CRD",
    ),
    ("InferencePool", "an upper-case name", _set("metadata", "name", value="Llama"), "metadata.name"),
    ("InferencePool", "a bad label key", _set("metadata", "labels", "-x", value="y"), "metadata.labels"),
    (
        "InferenceModelRewrite",
        "a zero weight",
        _set("spec", "rules", 0, "targets", 1, "weight", value=0),
        "less than the minimum of 1",
    ),
    (
        "InferenceModelRewrite",
        "a weight as text",
        _set("spec", "rules", 0, "targets", 1, "weight", value="5"),
        '"5" is not of type "integer"',
    ),
    (
        "InferenceModelRewrite",
        "weights on some targets only",
        _set("spec", "rules", 0, "targets", 1, "weight", value=DELETE),
        "not all",
    ),
    (
        "InferenceModelRewrite",
        "a regex match",
        _set("spec", "rules", 0, "matches", 0, "model", "type", value="RegularExpression"),
        "is not one of",
    ),
    ("InferenceModelRewrite", "no pool", _set("spec", "poolRef", value=DELETE), '"poolRef" is a required property'),
    (
        "InferenceObjective",
        "a priority past int32",
        _set("spec", "priority", value=2**31),
        "is greater than the maximum",
    ),
    (
        "InferenceService",
        "a quantity that is not one",
        _set("spec", "predictor", "model", "resources", "limits", "nvidia.com/gpu", value="two"),
        "does not match",
    ),
    (
        "InferenceService",
        "no model format name",
        _set("spec", "predictor", "model", "modelFormat", value={}),
        '"name" is a required property',
    ),
    ("InferenceService", "a name KServe refuses", _set("metadata", "name", value="1-llama"), "KServe names"),
    ("InferenceService", "no predictor", _set("spec", "predictor", value=DELETE), '"predictor" is a required property'),
    (
        "InferenceGraph",
        "weights summing to 99",
        _set("spec", "nodes", "root", "steps", 1, "weight", value=4),
        "sum to 99, not 100",
    ),
    (
        "InferenceGraph",
        "a router type KServe lacks",
        _set("spec", "nodes", "root", "routerType", value="Random"),
        "is not one of",
    ),
    (
        "InferenceGraph",
        "two targets in a step",
        _set("spec", "nodes", "root", "steps", 0, "serviceName", value="x"),
        "exactly one of",
    ),
    (
        "InferenceGraph",
        "no root node",
        _set("spec", "nodes", value={"main": {"routerType": "Sequence"}}),
        "no 'root' node",
    ),
]


@pytest.mark.parametrize(("kind", "what", "change", "said"), BROKEN, ids=[f"{k}: {w}" for k, w, _, _ in BROKEN])
def test_a_broken_document_is_refused(
    kind: str, what: str, change: Callable[[dict[str, Any]], None], said: str
) -> None:
    documents = {**rendered("gateway-api"), **rendered("kserve")}
    broken = copy.deepcopy(documents[kind])
    change(broken)
    found = problems(broken)
    assert found, f"{kind} with {what} was accepted"
    assert any(said in p for p in found), found


def test_names_stay_valid_and_distinct_whatever_kiln_names_allow() -> None:
    # A 64-character model name with dots, versions that differ only where Kubernetes names cannot
    # (1.4.0 and 1-4-0), one with build metadata ('+'): every object valid, no two services alike.
    versions = ("1.4.0", "1-4-0", "2.0.0+build.7")
    routing = ROUTING.model_copy(
        update={
            "model": "m" + ".x" * 31 + "y",
            "pools": (
                PoolRouting(
                    hardware="mi300x",
                    family="rocm",
                    free_devices=None,
                    placements=tuple(placement(v, w) for v, w in zip(versions, (5000, 3000, 2000), strict=True)),
                ),
            ),
        }
    )
    for fmt in ("gateway-api", "kserve"):
        if fmt == "kserve":  # build metadata has no OCI tag: its model car cannot be named
            with pytest.raises(KilnError, match="has no OCI tag"):
                get_format(fmt).render(routing, RenderOptions())
            tagged = (placement("1.4.0", 5000), placement("1-4-0", 5000))
            pool = PoolRouting(hardware="mi300x", family="rocm", free_devices=None, placements=tagged)
            documents = get_format(fmt).render(routing.model_copy(update={"pools": (pool,)}), RenderOptions())
        else:
            documents = get_format(fmt).render(routing, RenderOptions())
        for document in documents:
            assert problems(document) == [], document["metadata"]["name"]
        names = [(d["kind"], d["metadata"]["name"]) for d in documents]
        assert len(set(names)) == len(names)
        assert all(len(name) <= 63 for _, name in names)
