"""Every number the API takes has a documented range and a strict type, and no value at or past its
edges is a server error.

`test_every_numeric_input_sends_its_edges` walks the OpenAPI document: for each numeric query or path
parameter and each numeric field of a JSON body (nested objects and arrays too), it sends a valid
request with that one value replaced by the field's edges (minimum, maximum, just past each, 0, -0,
5e-324, 1e308, NaN, infinity, "50", true, null). Every answer is 2xx or 4xx with an error code; a
value outside the documented range, and in a body a string or a boolean, is refused; after every
accepted write, resolve on the seeded model (and on the hardware written) still answers. An eval
result's metrics and gate are the one exception (`EVALS`): evidence, taken as measured.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.core.errors import InvalidInput
from kiln.core.hardware import builtin_catalog, parse_profile
from kiln.core.performance import MAX_CONCURRENCY, MAX_CONTEXT
from kiln.core.shape import MAX_DIMENSION, ShapeRecord
from kiln.placement.fit import MAX_WEIGHTS_BYTES, plan_replica
from tests.registry.conftest import make_token
from tests.registry.helpers import (
    LLAMA_CONFIG,
    assert_error,
    eval_metrics,
    make_release,
    post_eval,
    promote,
    publish,
    seal,
)

JSON = {"Content-Type": "application/json"}
ARTIFACT = "/v1/models/tiny/releases/1.0/artifacts/gguf-q8"
# The seeded artifact runs on `cpu`; an entry with every field (interconnect, FP8, price, a measured record with a
# share of each peak) replaces it.
_SHARES = {"bf16": 0.8, "fp8": 0.6, "int8": 0.4}
CPU_AS_H100 = {
    **builtin_catalog().profiles["h100"].model_dump(mode="json"),
    "name": "cpu",
    "measured": {
        "memory_read": 0.9,
        "decode": _SHARES,
        "matmul": _SHARES,
        "matmul_small_m": _SHARES,
        "allocatable_gib": 78.5,
        "source": "numeric edges",
        "measured_on": "2026-11-26",
    },
}


@dataclass
class Base:
    """A valid request of one operation, to change one number of."""

    path: dict[str, Any] = field(default_factory=dict)
    query: dict[str, Any] = field(default_factory=dict)
    body: Any = None
    resolve_on: str = "cpu"  # the hardware resolve is asked about after an accepted write


def _performance() -> dict[str, Any]:
    return {
        "hardware": "cpu",
        "runtime": "llama.cpp",
        "runtime_version": "llama.cpp b4000",
        "tp": 1,
        "context": 4096,
        "concurrency": 1,
        "tokens_per_s": 40.0,
        "ttft_ms": 120.0,
        "itl_p50_ms": 25.0,
        "itl_p99_ms": 30.0,
    }


def _manifest_base() -> dict[str, Any]:
    data = b"q8" * 64
    return {
        "name": "gguf-q8",
        "target": "gguf",
        "format": "gguf-v3",
        "quant": "q8_0",
        "hardware": ["cpu"],
        "unsupported": {},
        "runtime": {"llama.cpp": ">=b4000"},
        "files": [{"path": "model.gguf", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}],
        "provenance": {"host": "test"},
    }


# An eval result's numbers (its metrics, and the gate they were judged by) are evidence as the runtime measured
# them, NaN and infinity included (a broken artifact's logits): stored and shown, never computed with beyond a
# comparison. They have no range to document; their edges are sent only to see that none is a server error.
EVALS = ("post", "/v1/models/{model}/releases/{version}/artifacts/{name}/evals")
EVIDENCE_EDGES = [0, -1, 5e-324, 1e308, math.nan, math.inf, -math.inf, "NaN", "50", True, None]

# A valid request for every operation that takes a number; a new one fails the walk until it is added.
BASES: dict[tuple[str, str], Base] = {
    ("get", "/v1/resolve"): Base(query={"model": "tiny", "hardware": "cpu"}),
    ("put", "/v1/hardware/{name}"): Base(path={"name": "cpu"}, body=CPU_AS_H100),
    ("post", "/v1/models/{model}/releases/{version}/artifacts/{name}/performance"): Base(
        path={"model": "tiny", "version": "1.0", "name": "gguf-q8"}, body=_performance()
    ),
    ("put", "/v1/models/{model}/channels/{channel}/split"): Base(
        path={"model": "tiny", "channel": "prod"},
        body={"weights": [{"version": "1.0", "weight": 100}]},
    ),
    ("post", "/v1/models/{model}/releases/{version}/artifacts"): Base(
        path={"model": "tiny", "version": "1.0"}, body=_manifest_base()
    ),
    ("post", "/v1/models/{model}/releases/{version}/artifacts/{name}/attestations"): Base(
        path={"model": "tiny", "version": "1.0", "name": "gguf-q8"},
        body={"kind": "provenance", "sha256": "0" * 64, "size": 100},
    ),
    EVALS: Base(
        path={"model": "tiny", "version": "1.0", "name": "gguf-q8"},
        body={"runtime": "edges", "status": "passed", "metrics": eval_metrics(), "gates": {"max_kl": 0.01}},
    ),
    # Every listing's page size (`limit`), and the id cursors (`after`) of those ordered by id.
    ("get", "/v1/models"): Base(),
    ("get", "/v1/models/{model}"): Base(path={"model": "tiny"}),
    ("get", "/v1/models/{model}/releases"): Base(path={"model": "tiny"}),
    ("get", "/v1/models/{model}/releases/{version}/artifacts"): Base(path={"model": "tiny", "version": "1.0"}),
    ("get", "/v1/models/{model}/releases/{version}/artifacts/{name}/performance"): Base(
        path={"model": "tiny", "version": "1.0", "name": "gguf-q8"}
    ),
    ("get", "/v1/models/{model}/channels"): Base(path={"model": "tiny"}),
    ("get", "/v1/models/{model}/channels/{channel}"): Base(path={"model": "tiny", "channel": "prod"}),
    ("get", "/v1/hardware"): Base(),
    ("get", "/api/models/{path}"): Base(path={"path": "tiny/tree/1.0%2Fgguf-q8"}),  # the Hub tree's page size
    ("get", "/v1/keys"): Base(),
    ("get", "/v1/tokens"): Base(),
    ("get", "/v1/webhooks"): Base(),
    ("get", "/v1/audit"): Base(),
    ("post", "/v1/tokens/{token_id}/revoke"): Base(path={"token_id": 1}, body={"reason": "numeric edges"}),
    ("get", "/v1/webhooks/{webhook_id}"): Base(path={"webhook_id": 1}),
    ("delete", "/v1/webhooks/{webhook_id}"): Base(path={"webhook_id": 1}),
    ("get", "/v1/webhooks/{webhook_id}/deliveries"): Base(path={"webhook_id": 1}),
    ("post", "/v1/webhooks/{webhook_id}/deliveries/{delivery_id}/redeliver"): Base(
        path={"webhook_id": 1, "delivery_id": 1}
    ),
}


def _resolve_ref(doc: dict[str, Any], node: Any) -> Any:
    while isinstance(node, dict) and "$ref" in node:
        target: Any = doc
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


@dataclass(frozen=True)
class NumericInput:
    method: str
    path: str
    where: str  # query | path | body
    pointer: tuple[str | int, ...]  # the parameter's name, or the keys down the body
    schema: dict[str, Any]  # type integer|number, with its range
    nullable: bool  # null is a value it takes (for a parameter: it may be left out)

    def __str__(self) -> str:
        return f"{self.method.upper()} {self.path} {self.where} {'.'.join(map(str, self.pointer))}"


def _numeric(doc: dict[str, Any], schema: Any) -> tuple[dict[str, Any] | None, bool]:
    """(the numeric alternative of `schema`, whether null is allowed)."""
    schema = _resolve_ref(doc, schema)
    options = [_resolve_ref(doc, s) for s in schema.get("anyOf", schema.get("oneOf", [schema]))]
    nullable = any(o.get("type") == "null" for o in options)
    numbers = [o for o in options if o.get("type") in ("integer", "number")]
    return (numbers[0] if numbers else None), nullable


def _walk_body(doc: dict[str, Any], schema: Any, pointer: tuple[str | int, ...]) -> list[tuple[tuple, dict, bool]]:
    found: list[tuple[tuple, dict, bool]] = []
    schema = _resolve_ref(doc, schema)
    number, nullable = _numeric(doc, schema)
    if number is not None:
        return [(pointer, number, nullable)]
    for option in schema.get("anyOf", [schema]):
        option = _resolve_ref(doc, option)
        for name, sub in option.get("properties", {}).items():
            found += _walk_body(doc, sub, (*pointer, name))
        if "items" in option:
            found += _walk_body(doc, option["items"], (*pointer, 0))
    return found


def numeric_inputs(doc: dict[str, Any]) -> list[NumericInput]:
    """Every numeric parameter and body field of every operation in an OpenAPI document."""
    inputs: list[NumericInput] = []
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            if method not in ("get", "put", "post", "patch", "delete"):
                continue
            for param in op.get("parameters", []):
                number, nullable = _numeric(doc, param.get("schema", {}))
                if number is not None:
                    optional = nullable or not param.get("required", False)
                    inputs.append(NumericInput(method, path, param["in"], (param["name"],), number, optional))
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is not None:
                for pointer, number, nullable in _walk_body(doc, body, ()):
                    inputs.append(NumericInput(method, path, "body", pointer, number, nullable))
    return inputs


def _range(schema: dict[str, Any]) -> tuple[float, bool, float]:
    """(low, whether low itself is allowed, high)."""
    if "exclusiveMinimum" in schema:
        return schema["exclusiveMinimum"], False, schema["maximum"]
    return schema["minimum"], True, schema["maximum"]


def edge_values(schema: dict[str, Any]) -> list[Any]:
    low, _, high = _range(schema)
    if schema["type"] == "integer":
        below, above = low - 1, high + 1
    else:
        below, above = math.nextafter(low, -math.inf), math.nextafter(high, math.inf)
    return [low, high, below, above, 0, -0.0, 5e-324, 1e308, math.nan, math.inf, -math.inf, "50", True, None]


def in_range(schema: dict[str, Any], value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if schema["type"] == "integer" and value != int(value):
        return False
    low, inclusive, high = _range(schema)
    return (low <= value if inclusive else low < value) and value <= high


def _with(body: Any, pointer: tuple[str | int, ...], value: Any) -> Any:
    body = json.loads(json.dumps(body))
    target = body
    for key in pointer[:-1]:
        target = target[key]
    target[pointer[-1]] = value
    return body


def _query_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true"
    return repr(value) if isinstance(value, float) else str(value)


def error_code(response: Any) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("code")
    if isinstance(body, dict) and isinstance(body.get("errors"), list) and body["errors"]:  # OCI's shape
        return body["errors"][0].get("code")
    return None


def _seed(client: TestClient) -> None:
    make_release(client, planned=["gguf-q8"], model_config=LLAMA_CONFIG)
    publish(client, "gguf-q8", {"model.gguf": b"q8" * 64}, ["cpu"])
    assert post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.001}).status_code in (200, 201)
    seal(client)
    assert promote(client).status_code == 200


def _send(client: TestClient, item: NumericInput, base: Base, value: Any) -> Any:
    path_params = dict(base.path)
    query = dict(base.query)
    body = base.body
    if item.where == "path":
        path_params[str(item.pointer[0])] = _query_text(value) if value is not None else "null"
    elif item.where == "query":
        query[str(item.pointer[0])] = _query_text(value)
    else:
        body = _with(body, item.pointer, value)
    url = item.path.format(**path_params)
    query = {k: v for k, v in query.items() if v is not None}
    if query:
        url += "?" + urlencode(query)
    content = json.dumps(body) if body is not None else None  # NaN and Infinity as Python's JSON writes them
    return client.request(item.method.upper(), url, content=content, headers=JSON if content else None)


def _may_take(item: NumericInput, value: Any) -> bool:
    """Values outside the range that are still right to accept: null where it is allowed, and "50" in a
    query or path (where every value is text)."""
    return (value is None and item.nullable) or (item.where != "body" and value == "50" and in_range(item.schema, 50))


def test_every_numeric_input_has_a_range(client: TestClient) -> None:
    inputs = numeric_inputs(client.get("/openapi.json").json())
    assert len(inputs) >= 20
    unbounded = [
        str(i)
        for i in inputs
        if (i.method, i.path) != EVALS
        and not ({"minimum", "exclusiveMinimum"} & set(i.schema) and "maximum" in i.schema)
    ]
    assert not unbounded, unbounded


def test_every_numeric_input_sends_its_edges(app: FastAPI, client: TestClient) -> None:
    _seed(client)
    # Its own admin token: the edges of a token id revoke token 1, the fixture's.
    client.headers["Authorization"] = f"Bearer {make_token(app, ['admin'], name='edges')}"
    inputs = numeric_inputs(app.openapi())
    missing = sorted({(i.method, i.path) for i in inputs} - set(BASES))
    assert not missing, f"no valid request to vary for {missing}: add one to BASES"
    problems: list[str] = []
    sent = 0
    for item in inputs:
        base = BASES[(item.method, item.path)]
        evidence = (item.method, item.path) == EVALS
        for value in EVIDENCE_EDGES if evidence else edge_values(item.schema):
            response = _send(client, item, base, value)
            sent += 1
            status = response.status_code
            code = error_code(response)
            where = f"{item} = {value!r}: {status} {response.text[:300]}"
            if status >= 500 or (status >= 400 and not code):
                problems.append(where)
            elif status < 400 and not evidence and not in_range(item.schema, value) and not _may_take(item, value):
                problems.append("accepted out of range: " + where)
            if status < 300 and item.method != "get":
                after = client.get("/v1/resolve", params={"model": "tiny", "hardware": base.resolve_on})
                if after.status_code >= 500 or (after.status_code >= 400 and not error_code(after)):
                    problems.append(f"resolve after {where}: {after.status_code} {after.text[:300]}")
    assert sent > 200
    assert not problems, f"{len(problems)} of {sent}:\n" + "\n".join(problems[:40])


def _two_sealed_releases(client: TestClient) -> None:
    _seed(client)
    make_release(client, version="2.0", planned=["gguf-q8"])
    publish(client, "gguf-q8", {"model.gguf": b"v2" * 64}, ["cpu"], version="2.0")
    assert post_eval(client, "gguf-q8", "passed", version="2.0", metrics={"kl": 0.002}).status_code in (200, 201)
    seal(client, version="2.0")


def test_split_weights_are_numbers_of_at_least_one_basis_point(client: TestClient) -> None:
    _two_sealed_releases(client)
    split = "/v1/models/tiny/channels/prod/split"
    for small in (1e-10, 5e-324, 0.001, 0.005, 0):  # under 0.01 %: no key bucket for it
        response = client.put(
            split, json={"weights": [{"version": "1.0", "weight": 100}, {"version": "2.0", "weight": small}]}
        )
        assert_error(response, 422, "INVALID_INPUT")
    for text in ("50", True, None, [50], {"percent": 50}):  # a JSON number, nothing that converts to one
        response = client.put(
            split, json={"weights": [{"version": "1.0", "weight": 50}, {"version": "2.0", "weight": text}]}
        )
        assert_error(response, 422, "INVALID_INPUT")
    for weights in ((99.99, 0.01), (95, 5), (66.67, 33.33), (50.5, 49.5)):
        body = {"weights": [{"version": v, "weight": w} for v, w in zip(("1.0", "2.0"), weights, strict=True)]}
        response = client.put(split, json=body)
        assert response.status_code == 200, response.text
        assert [m["weight"] for m in response.json()["split"]] == list(weights)
        for key in ("a", "b", "c"):
            assert client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu", "key": key}).status_code == 200


@pytest.mark.parametrize(
    "change",
    [
        {"bandwidth_gbs": 5e-324},
        {"memory_gib": 5e-324},
        {"tflops": {"bf16": 5e-324, "fp8": 1979, "int8": 1979}},
        {"interconnect": {"name": "NVLink 4", "bandwidth_gbs": 900, "tp_efficiency": 5e-324}},
        {"interconnect": {"name": "NVLink 4", "bandwidth_gbs": 900, "tp_efficiency": 0.05}},
        {"price_per_device_hour": 1e308},
        {"memory_gib": "80"},
        {"devices_per_node": True},
        {"price_per_device_hour": "2.99"},
        {"measured": {**CPU_AS_H100["measured"], "memory_read": 5e-324}},
        {"measured": {**CPU_AS_H100["measured"], "matmul": {"bf16": 1e308}}},
    ],
)
def test_hardware_facts_outside_their_range_are_refused_and_resolve_still_answers(
    client: TestClient, change: dict[str, Any]
) -> None:
    _seed(client)
    error = assert_error(
        client.put("/v1/hardware/cpu", json={**CPU_AS_H100, **change}), 422, "HARDWARE_CATALOG_INVALID"
    )
    assert next(iter(change)) in error["message"]
    assert client.get("/v1/hardware/cpu").json()["source"] == "builtin"
    response = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"})
    assert response.status_code == 200, response.text
    assert math.isfinite(response.json()["reason"]["decode_tokens_per_s_bound"])


def test_replica_bounds_stay_finite_at_the_catalogs_extremes() -> None:
    """The slowest and the fastest device the catalog accepts, at the smallest and largest workloads
    resolve takes, for a real shape and the largest a config may state: every bound finite and positive."""
    h100 = builtin_catalog().profiles["h100"].model_dump(mode="json")
    slowest = {
        **h100,
        "memory_gib": 1,
        "bandwidth_gbs": 1,
        "tflops": {"bf16": 0.01, "fp8": 0.01, "int8": 0.01},
        "interconnect": {"name": "slow link", "bandwidth_gbs": 1, "tp_efficiency": 0.0501},
        "devices_per_node": 1024,
        "price_per_device_hour": 10_000,
        "measured": {
            "memory_read": 0.001,
            "decode": {"fp8": 0.001},
            "matmul": {"fp8": 0.001},
            "allocatable_gib": 1,
            "source": "the smallest shares",
            "measured_on": "2026-11-26",
        },
    }
    fastest = {
        **h100,
        "memory_gib": 16_384,
        "bandwidth_gbs": 100_000,
        "tflops": {"bf16": 100_000, "fp8": 100_000, "int8": 100_000},
        "interconnect": {"name": "fast link", "bandwidth_gbs": 100_000, "tp_efficiency": 1},
        "devices_per_node": 1024,
        "price_per_device_hour": 0,
        "measured": {
            "memory_read": 2,
            "decode": {"fp8": 2},
            "matmul": {"fp8": 2},
            "allocatable_gib": 16_384,
            "source": "the largest shares",
            "measured_on": "2026-11-26",
        },
    }
    huge = {key: MAX_DIMENSION for key in (*LLAMA_CONFIG, "intermediate_size")}
    for entry in (slowest, fastest):
        profile = parse_profile(entry)
        for config in ({**LLAMA_CONFIG, "intermediate_size": 14336}, huge):
            for context, concurrency, weights in ((1, 1, 0), (MAX_CONTEXT, MAX_CONCURRENCY, MAX_WEIGHTS_BYTES)):
                plan = plan_replica(profile, ShapeRecord.from_untrusted(config), weights, "fp8", context, concurrency)
                bounds = (
                    plan.decode_tokens_per_s,
                    plan.decode_tokens_per_s_per_sequence,
                    plan.ttft_s,
                    plan.cost_per_mtok,
                )
                assert all(isinstance(b, float) and math.isfinite(b) and b >= 0 for b in bounds), (entry, config, plan)
                assert plan.decode_tokens_per_s > 0 and plan.ttft_s and plan.prefill_tokens_per_s


def test_plan_replica_refuses_a_profile_built_around_validation() -> None:
    """A profile made without validation (model_construct) or stored by an older kiln: a clear error, no division."""
    h100 = builtin_catalog().profiles["h100"]
    shape = ShapeRecord.from_untrusted(LLAMA_CONFIG)
    for change in (
        {"bandwidth_gbs": 5e-324},
        {"bandwidth_gbs": 0.0},
        {"memory_gib": math.inf},
        {"price_per_device_hour": -1.0},
    ):
        profile = type(h100).model_construct(**{**dict(h100), **change})
        with pytest.raises(InvalidInput) as raised:
            plan_replica(profile, shape, 16 * 2**30, "bf16", 4096, 1)
        assert raised.value.code == "HARDWARE_CATALOG_INVALID" and next(iter(change)) in raised.value.message
    assert h100.interconnect is not None
    link = h100.interconnect.model_construct(**{**dict(h100.interconnect), "tp_efficiency": 5e-324})
    profile = type(h100).model_construct(**{**dict(h100), "interconnect": link})
    with pytest.raises(InvalidInput, match="tp_efficiency"):
        plan_replica(profile, shape, 100 * 2**30, "bf16", 4096, 1)  # 100 GiB: TP 2, over the link
    measured = builtin_catalog().profiles["h200"].measured
    assert measured is not None
    for name, value in (("memory_read", 0.0), ("memory_read", math.nan), ("allocatable_gib", 0.0)):
        bad = measured.model_construct(**{**dict(measured), name: value})
        profile = type(h100).model_construct(**{**dict(h100), "measured": bad})
        with pytest.raises(InvalidInput) as raised:
            plan_replica(profile, shape, 16 * 2**30, "bf16", 4096, 1)
        assert raised.value.code == "HARDWARE_CATALOG_INVALID" and f"measured.{name}" in raised.value.message


def test_a_stored_measurement_outside_todays_range_is_not_used(app: FastAPI, client: TestClient) -> None:
    """A record an older kiln accepted (any positive number) is left out; resolve estimates instead."""
    from kiln.registry.artifacts.models import Artifact
    from kiln.registry.performance.models import PerformanceRecord

    _seed(client)
    with app.state.session_factory() as session:
        artifact = session.query(Artifact).filter_by(name="gguf-q8").one()
        tiny = {**_performance(), "tokens_per_s": 5e-324, "ttft_ms": 5e-324, "itl_p50_ms": 5e-324, "itl_p99_ms": 5e-324}
        session.add(PerformanceRecord(artifact_id=artifact.id, recorded_by="older kiln", **tiny))
        session.commit()
    client.put("/v1/hardware/cpu", json={**builtin_catalog().profiles["cpu"].model_dump(mode="json")})  # a new revision
    response = client.get("/v1/resolve", params={"model": "tiny", "hardware": "cpu"})
    assert response.status_code == 200, response.text
    reason = response.json()["reason"]
    assert reason["speed_source"] == "estimate" and reason["measured"] is None
    for name in ("tokens_per_s", "tokens_per_s_per_sequence", "cost_per_mtok"):
        assert isinstance(reason[name], float) and math.isfinite(reason[name]), (name, reason)
