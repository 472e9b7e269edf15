"""The hardware catalog's request body, as the API documents it (the answers are `core.hardware.HardwareOut`)."""

from __future__ import annotations

from typing import Any

from kiln.core.hardware import HardwareProfile


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def entry_request_schema() -> dict[str, Any]:
    """The OpenAPI schema of a PUT body: a catalog entry (the name optional, `source` ignored), self-contained.

    The route validates the body itself (`core.hardware.parse_profile`, HARDWARE_CATALOG_INVALID); this
    documents the same model, with each number's range, for clients and for schema-driven tests."""
    schema = HardwareProfile.model_json_schema()
    schema = _inline(schema, schema.pop("$defs", {}))
    schema["required"] = [f for f in schema.get("required", []) if f != "name"]
    schema["properties"]["source"] = {"type": "string", "description": "as GET shows it; ignored"}
    schema["title"] = "HardwareEntry"
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
    }
