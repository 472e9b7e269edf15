"""The hardware catalog: one data file, validated, and the only place kiln learns about a device."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.core.datafile import MAX_DATA_FILE_BYTES
from kiln.core.errors import DataFileInvalid, InvalidInput, UnknownName
from kiln.core.hardware import CATALOG_FILE, PROFILES, builtin_catalog, load_catalog, parse_profile

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"cuda", "rocm", "tpu", "cpu", "metal"}


def _entry(**changes: object) -> dict[str, object]:
    entry = PROFILES["h100"].model_dump(mode="json")
    entry.update(changes)
    return entry


def test_the_builtin_catalog_is_the_data_file() -> None:
    data = yaml.safe_load(CATALOG_FILE.read_text())
    assert [e["name"] for e in data["hardware"]] == list(PROFILES)
    h100 = PROFILES["h100"]
    assert (h100.memory_gib, h100.bandwidth_gbs, h100.devices_per_node, h100.fp8) == (80, 3350, 8, "e4m3fn")
    assert h100.interconnect is not None and h100.interconnect.tp_efficiency == 0.85
    assert PROFILES["mi300x"].fp8 == "e4m3fnuz" and PROFILES["mi355x"].fp8 == "e4m3fn"
    assert PROFILES["tpu-v5e"].matmul_tflops("fp8") == (197, "bf16")  # no FP8 units: bf16


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"compute_capability": None}, "compute_capability"),
        ({"family": "rocm"}, "compute_capability"),
        ({"memory_gib": -1}, "memory_gib"),
        ({"memory_gib": "lots"}, "memory_gib"),
        ({"bandwidth_gbs": float("nan")}, "bandwidth_gbs"),
        ({"interconnect": None}, "interconnect"),
        ({"fp8": "e5m2"}, "fp8"),
        ({"tflops": {"bf16": 989}}, "tflops.fp8"),
        ({"name": "H100/../x"}, "name"),
        ({"products": ["\x00"]}, "products"),
        ({"nvlink": True}, "nvlink"),
        ({"devices_per_node": 0}, "devices_per_node"),
        ({"price_per_device_hour": -2}, "price_per_device_hour"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_profile(_entry(**changes))
    assert e.value.code == "HARDWARE_CATALOG_INVALID"
    assert field.split(".")[0] in e.value.message or "entry" in e.value.message


def test_a_catalog_file_that_lists_an_sku_twice_or_is_not_a_catalog_is_refused(tmp_path: Path) -> None:
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump({"schema": 1, "hardware": [_entry(), _entry()]}))
    with pytest.raises(InvalidInput, match="listed twice"):
        load_catalog(twice)
    for text in ("[]", "schema: 2\nhardware: []", "schema: 1\nhardware: {}", "schema: 1\nhardware: [3]"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(InvalidInput) as e:
            load_catalog(bad)
        assert e.value.code == "HARDWARE_CATALOG_INVALID"


def test_an_unknown_sku_lists_the_known_ones() -> None:
    with pytest.raises(UnknownName) as e:
        builtin_catalog().get("h1000")
    assert "h100" in e.value.message and e.value.details["known"] == sorted(PROFILES)


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_code_names_an_sku_every_hardware_fact_is_in_the_catalog() -> None:
    # A family name that is also an SKU ("cpu") is a family in code; every other SKU name only in data.
    skus = set(PROFILES) - FAMILIES
    found = [
        f"{path.relative_to(ROOT)}:{line}: {value!r}"
        for package in ("targets", "quant", "pipeline", "eval", "formats")
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, value in _string_constants(path)
        if value in skus
    ]
    assert found == []


NEW_SKUS = [
    _entry(name="h20", memory_gib=96, bandwidth_gbs=4000, tflops={"bf16": 148, "fp8": 296}, products=["H20"]),
    {
        **PROFILES["mi300x"].model_dump(mode="json"),
        "name": "mi308x",
        "tflops": {"bf16": 500, "fp8": 1000},
        "products": ["MI308X"],
    },
    {**PROFILES["tpu-v5p"].model_dump(mode="json"), "name": "tpu-v6e", "arch": "tpu-v6e", "memory_gib": 32},
    {**PROFILES["edge"].model_dump(mode="json"), "name": "rpi5", "memory_gib": 8, "products": ["Raspberry Pi 5"]},
]

PROBE = """
import json
from kiln.core.hardware import PROFILES
from kiln.pipeline.requirements import RUNNER_LABELS, accelerator
from kiln.targets.base import get_target
from kiln.targets.rocm_bundle.export import ROCM_ARCHES, arch_hardware
from kiln.targets.trtllm.formats import ENGINE_SKUS

hf = get_target("hf-bundle")
print(json.dumps({
    "catalog": sorted(PROFILES),
    "hf_fp8": {hw: v.compatible for hw, v in hf.compatibility("fp8").items()},
    "hf_fp8_reason": hf.compatibility("fp8")["mi308x"].reason,
    "rocm": get_target("rocm-bundle").hardware,
    "gfx942": arch_hardware("gfx942"),
    "orbax": get_target("orbax").hardware,
    "gguf": get_target("gguf").hardware,
    "engine_skus": ENGINE_SKUS,
    "trtllm_fp8": {hw: v.compatible for hw, v in get_target("trtllm").compatibility("fp8").items()},
    "runner": RUNNER_LABELS[accelerator("h20")],
}))
"""


def test_adding_an_sku_is_one_catalog_entry(tmp_path: Path) -> None:
    extra = tmp_path / "site.yaml"
    extra.write_text(yaml.safe_dump({"schema": 1, "hardware": NEW_SKUS}))
    env = {**os.environ, "KILN_HARDWARE_CATALOG": str(extra), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    seen = json.loads(out.stdout)
    assert {"h20", "mi308x", "tpu-v6e", "rpi5"} <= set(seen["catalog"])
    assert seen["hf_fp8"]["h20"] and seen["hf_fp8"]["mi308x"]  # FP8 by the catalog's fp8 field
    assert not seen["hf_fp8"]["tpu-v6e"] and not seen["hf_fp8"]["rpi5"]
    assert "float8_e4m3fnuz" in seen["hf_fp8_reason"]
    assert "mi308x" in seen["rocm"] and "mi308x" in seen["gfx942"]
    assert "tpu-v6e" in seen["orbax"] and "rpi5" in seen["gguf"]
    assert seen["engine_skus"]["h20"] == "H20" and seen["trtllm_fp8"]["h20"]
    assert seen["runner"] == ["self-hosted", "gpu", "h20"]


def test_a_missing_extension_file_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "KILN_HARDWARE_CATALOG": str(tmp_path / "nope.yaml"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", "import kiln.core.hardware"], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode != 0 and "KILN_HARDWARE_CATALOG" in out.stderr and "no such file" in out.stderr.lower()
    assert "DataFileInvalid" in out.stderr


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p.mkdir(), "regular file"),
        (lambda p: p.write_bytes(b"schema: 1\nhardware: [\xff]\n"), "not UTF-8"),
        (lambda p: p.write_text("schema: 1\nhardware: [{name: x, memory_gib: .nan}]\n"), "JSON"),
        (lambda p: p.write_text("schema: 1\nhardware: [\n"), "not valid YAML"),
        (lambda p: p.write_bytes(b"#" * (MAX_DATA_FILE_BYTES + 1)), "larger than"),
    ],
    ids=["directory", "not-utf8", "nan", "not-yaml", "too-large"],
)
def test_a_catalog_file_is_read_as_every_data_file_is(tmp_path: Path, make: Any, why: str) -> None:
    """The extension (and the built-in file) go through `core.datafile`: refused as DATA_FILE_INVALID,
    naming the file and what it is."""
    path = tmp_path / "site.yaml"
    make(path)
    with pytest.raises(DataFileInvalid) as e:
        load_catalog(path, "the hardware catalog KILN_HARDWARE_CATALOG names")
    assert e.value.code == "DATA_FILE_INVALID" and why in e.value.message and str(path) in e.value.message
    assert e.value.details == {"file": str(path)}


def test_a_dated_measurement_in_a_catalog_file_stays_the_text_written(tmp_path: Path) -> None:
    """A `measured_on` date left unquoted is read as the string it is (as JSON would hold it), not a date."""
    entry = next(e for e in yaml.safe_load(CATALOG_FILE.read_text())["hardware"] if "measured" in e)
    text = yaml.safe_dump({"schema": 1, "hardware": [{**entry, "name": "site-sku"}]})
    site = tmp_path / "site.yaml"
    site.write_text(text.replace("'2026-11-26'", "2026-11-26"))
    assert load_catalog(site).get("site-sku").name == "site-sku"
