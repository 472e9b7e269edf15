"""Rendered objects checked as a Kubernetes API server holding the vendored CRDs (tests/kiln/routing/crds/) would.

Each document is validated against the `openAPIV3Schema` of the CRD version its `apiVersion` and `kind` name,
read as Kubernetes reads a structural schema: an object's fields are those its schema lists (kubectl's
default field validation, `Strict`, refuses any other unless `x-kubernetes-preserve-unknown-fields`),
`nullable` admits null, `format: int32`/`int64` bound integers, and the CRDs' CEL rules
(`x-kubernetes-validations`) are evaluated by the checks in `CEL_RULES`: a rule met on a rendered value
that is not there fails the validation rather than pass unchecked. `metadata` is checked against the
ObjectMeta rules for the fields kiln writes (name, namespace, labels, annotations: apimachinery's
`ValidateObjectMeta`). KServe's admission webhook adds its own checks, which `ADMISSION` makes, from
pkg/apis/serving/{v1beta1/inference_service,v1alpha1/inference_graph}_validation.go at v0.20.0; the
InferenceModelRewrite's all-or-none weights are its types' rule (apix/v1alpha2/inferencemodelrewrite_types.go).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs
import yaml

CRD_DIR = Path(__file__).with_name("crds")

_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_NAME = rf"^({_SUBDOMAIN}/)?([A-Za-z0-9][-A-Za-z0-9_.]{{0,61}})?[A-Za-z0-9]$"
OBJECT_META: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": f"^{_SUBDOMAIN}$"},
        "namespace": {"type": "string", "maxLength": 63, "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": {
            "type": "object",
            "propertyNames": {"pattern": _QUALIFIED_NAME},
            "additionalProperties": {"type": "string", "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"},
        },
        "annotations": {
            "type": "object",
            "propertyNames": {"pattern": _QUALIFIED_NAME},
            "additionalProperties": {"type": "string"},
        },
    },
}
MAX_ANNOTATIONS_BYTES = 256 * 1024  # apimachinery TotalAnnotationSizeLimitB
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _ports_unique(ports: list[dict[str, Any]]) -> bool:
    return all(sum(q.get("number") == p.get("number") for q in ports) == 1 for p in ports)


# The CRDs' CEL rules, by their exact text, as the checks they make (defaults applied, as the API server
# applies them before validating: an endpointPickerRef's kind is Service unless given).
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self.kind != 'Service' || has(self.port)": lambda ref: ref.get("kind", "Service") != "Service" or "port" in ref,
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": _ports_unique,
}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD schema as JSON Schema with Kubernetes' reading of it (see the module's docstring)."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    for key in ("properties", "patternProperties"):
        if key in out:
            out[key] = {name: structural(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = structural(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [structural(sub) for sub in out[key]]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("type") == "integer" and schema.get("format") in _INT_RANGES:
        low, high = _INT_RANGES[schema["format"]]
        out["minimum"], out["maximum"] = max(out.get("minimum", low), low), min(out.get("maximum", high), high)
    keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-embedded-resource")
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    schema: dict[str, Any]  # as the CRD gives it (for its CEL rules)
    validator: Any  # jsonschema_rs validator of `structural(schema)`
    source: str  # the CRD file


def _load(path: Path) -> Iterator[Kind]:
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    for version in crd["spec"]["versions"]:
        if not version.get("served"):
            continue
        api_version = f"{group}/{version['name']}"
        schema = version["schema"]["openAPIV3Schema"]
        checked = structural(schema)
        checked["properties"]["metadata"] = OBJECT_META
        checked["properties"]["apiVersion"] = {"const": api_version}
        checked["properties"]["kind"] = {"const": kind}
        checked["required"] = sorted({*checked.get("required", []), "apiVersion", "kind", "metadata", "spec"})
        yield Kind(api_version, kind, schema, jsonschema_rs.Draft7Validator(checked), path.name)


@functools.cache
def kinds() -> dict[tuple[str, str], Kind]:
    """Every served (apiVersion, kind) of the vendored CRDs."""
    return {(k.api_version, k.kind): k for path in sorted(CRD_DIR.glob("*.yaml")) for k in _load(path)}


def _cel(schema: dict[str, Any], value: Any, path: str) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations", []):
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            yield f"{path}: CEL rule {rule['rule']!r} is not checked here (add it to CEL_RULES)"
        elif not check(value):
            yield f"{path}: {rule.get('message', rule['rule'])}"
    if isinstance(value, dict):
        for name, sub in value.items():
            if name in schema.get("properties", {}):
                yield from _cel(schema["properties"][name], sub, f"{path}.{name}".lstrip("."))
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from _cel(schema["additionalProperties"], sub, f"{path}.{name}".lstrip("."))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            yield from _cel(schema["items"], sub, f"{path}[{i}]")


_KSERVE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # IsvcNameFmt, GraphNameFmt


def _kserve_name(doc: dict[str, Any]) -> Iterator[str]:
    name = doc["metadata"]["name"]
    if not _KSERVE_NAME.fullmatch(name):
        yield f"metadata.name {name!r}: KServe names are lower-case letters, digits and '-', starting with a letter"


def _inference_graph(doc: dict[str, Any]) -> Iterator[str]:
    nodes = doc["spec"]["nodes"]
    if "root" not in nodes:
        yield "spec.nodes: no 'root' node"
    for name, node in nodes.items():
        steps = node.get("steps", [])
        named = [s["name"] for s in steps if s.get("name")]
        if len(named) != len(set(named)):
            yield f"spec.nodes.{name}: step names repeat: {named}"
        for i, step in enumerate(steps):
            if sum(bool(step.get(k)) for k in ("nodeName", "serviceName", "serviceUrl")) != 1:
                yield f"spec.nodes.{name}.steps[{i}]: exactly one of nodeName, serviceName, serviceUrl"
        if node["routerType"] == "Splitter":
            weights = [s.get("weight") for s in steps]
            if None in weights:
                yield f"spec.nodes.{name}: a Splitter step has no weight"
            elif sum(weights) != 100:
                yield f"spec.nodes.{name}: the Splitter's weights sum to {sum(weights)}, not 100"


def _rewrite_weights(doc: dict[str, Any]) -> Iterator[str]:
    for i, rule in enumerate(doc["spec"]["rules"]):
        weighted = ["weight" in t for t in rule.get("targets", [])]
        if any(weighted) and not all(weighted):
            yield f"spec.rules[{i}].targets: a weight is set for some targets and not all"


ADMISSION: dict[tuple[str, str], tuple[Callable[[dict[str, Any]], Iterator[str]], ...]] = {
    ("serving.kserve.io/v1beta1", "InferenceService"): (_kserve_name,),
    ("serving.kserve.io/v1alpha1", "InferenceGraph"): (_kserve_name, _inference_graph),
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceModelRewrite"): (_rewrite_weights,),
}


def _path(parts: list[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or "(document)"


def problems(doc: Any) -> list[str]:
    """Why the API server (or KServe's webhook) would refuse `doc`; empty when it would accept it."""
    if not isinstance(doc, dict):
        return [f"not an object: {type(doc).__name__}"]
    key = (doc.get("apiVersion"), doc.get("kind"))
    kind = kinds().get(key)  # type: ignore[arg-type]
    if kind is None:
        return [f"no vendored CRD serves {key[0]} {key[1]}"]
    found = [f"{_path(list(e.instance_path))}: {e.message}" for e in kind.validator.iter_errors(doc)]
    if found:
        return found
    found.extend(_cel(kind.schema, doc, ""))
    metadata = doc["metadata"]
    for field in ("labels", "annotations"):
        for name in metadata.get(field, {}):
            if len(name.partition("/")[0]) > 253 and "/" in name:
                found.append(f"metadata.{field}: the prefix of {name[:40]!r}... is longer than 253 characters")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.get("annotations", {}).items())
    if size > MAX_ANNOTATIONS_BYTES:
        found.append(f"metadata.annotations: {size} bytes, more than {MAX_ANNOTATIONS_BYTES}")
    for check in ADMISSION.get(key, ()):  # type: ignore[call-overload]
        found.extend(check(doc))
    return found


def assert_valid(doc: Any) -> None:
    found = problems(doc)
    assert not found, f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: " + "; ".join(found)
