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
