"""Every registry domain with tables has its import contract: another domain uses them only through its
service (`pyproject.toml`'s protected contracts, which `lint-imports` checks in `make lint`). A domain added
without one would let any other domain query its tables unnoticed."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_domain_with_tables_is_protected_by_a_contract() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    protected = {
        module: contract
        for contract in contracts
        if contract["type"] == "protected"
        for module in contract["protected_modules"]
    }
    domains = sorted(p.parent.name for p in (ROOT / "registry").glob("*/models.py"))
    assert domains
    for domain in domains:
        contract = protected.get(f"kiln.registry.{domain}.models")
        assert contract is not None, f"registry/{domain}/models.py has no protected contract in pyproject.toml"
        assert set(contract["allowed_importers"]) == {f"kiln.registry.{domain}", "kiln.registry.schema"}, domain


def test_the_registry_inner_layers_hold_without_exceptions() -> None:
    """The domains' layers (docs/registry.md) have no listed exceptions: a domain above hands a lower one
    what it needs (`releases.followers`, `blobs.references`), it is never imported from below."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["kiln.registry"]]
    assert {"oci", "channels", "releases", "attestations", "artifacts", "blobs"} <= set(layers["layers"])
    assert not layers.get("ignore_imports"), layers["ignore_imports"]
