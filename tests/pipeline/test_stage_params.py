"""Stage params are typed per stage kind (`pipeline.records`): every node the bundled example recipes plan holds
params its stage's record accepts and writes back key for key (the JSON its cache key hashes), and a param a
record does not know, or one it needs and does not find, is refused naming the field before any stage runs."""

from __future__ import annotations

import shutil
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kiln.core.device import CPU, Device
from kiln.core.digest import canonical_json
from kiln.pipeline import build
from kiln.pipeline.placement import with_device
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.records import QuantizeParams
from kiln.pipeline.requirements import planning_device
from kiln.pipeline.stage import Node
from kiln.pipeline.stages import export as export_stage
from kiln.pipeline.stages import quantize as quantize_stage
from kiln.pipeline.store import open_store

EXAMPLES = Path(__file__).parents[2] / "examples"
RECIPES = sorted(d.name for d in EXAMPLES.iterdir() if (d / "kiln.yaml").is_file())
KINDS = {"ingest", "prepare", "reference", "quantize", "export", "eval", "gpu-eval", "engine", "publish", "seal"}


def _plan(recipe_path: Path, device: Device, gpu: str | None, work: Path) -> list[Node]:
    recipe = load_recipe(recipe_path)
    store = open_store(None, work)
    return build.plan(recipe, store, registry="http://registry.invalid", device=device, gpu=gpu, hash_source=False)


@cache
def planned(example: str, kind: str) -> list[Node]:
    """The graph `kiln publish` plans for an example, its compute stages on the CPU or on an H200."""
    import tempfile

    device, gpu = (CPU, None) if kind == "cpu" else (planning_device("cuda", "h200"), "h200")
    with tempfile.TemporaryDirectory() as work:
        return _plan(EXAMPLES / example / "kiln.yaml", device, gpu, Path(work))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> list[Node]:
    """Llama-3-70B's shape with a legacy TensorRT engine per SKU beside the GPU evals (no example builds one)."""
    root = tmp_path_factory.mktemp("engines")
    shutil.copy(EXAMPLES / "llama-3-70b" / "config.json", root / "config.json")
    doc = yaml.safe_load((EXAMPLES / "llama-3-70b" / "kiln.yaml").read_text())
    doc["targets"] = [
        {
            "target": "trtllm",
            "quants": ["bf16"],
            "params": {
                "gpus": {"skus": ["h100"]},
                "legacy_engines": {"skus": ["h100"], "max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512},
            },
        }
    ]
    doc["eval"]["gates"] = {"bf16": {"max_kl": 0.01, "min_top1": 0.5}}
    (root / "kiln.yaml").write_text(yaml.safe_dump(doc))
    return _plan(root / "kiln.yaml", CPU, None, root / "work")


def assert_typed(nodes: list[Node]) -> None:
    for node in nodes:
        record = node.stage.params
        assert record is not None, f"{node.id}: stage {node.stage.name} declares no params record"
        again = record.model_validate(node.params).as_params()
        assert again == node.params, node.id
        assert canonical_json(again) == canonical_json(node.params), node.id  # what the cache key hashes


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
@pytest.mark.parametrize("example", RECIPES)
def test_every_planned_node_holds_its_stage_kinds_params(example: str, kind: str) -> None:
    nodes = planned(example, kind)
    assert {n.stage.name for n in nodes} <= KINDS
    assert_typed(nodes)


def test_derived_nodes_hold_their_params(engines: list[Node]) -> None:
    assert {n.stage.name for n in engines} >= {"gpu-eval", "engine"}
    assert_typed(engines)
    gpu_eval = next(n for n in engines if n.stage.name == "gpu-eval")
    assert (gpu_eval.params["gate"]["max_kl"], gpu_eval.params["gate"]["min_top1"]) == (0.01, 0.5)
    assert "gate" not in next(n for n in engines if n.stage.name == "engine").params


def node_of(stage: str) -> Node:
    return next(n for n in planned("tiny-llama", "cpu") if n.stage.name == stage)


@pytest.mark.parametrize("stage", sorted(KINDS - {"gpu-eval", "engine"}))
def test_an_unknown_param_is_refused_naming_it(stage: str) -> None:
    node = node_of(stage)
    assert node.stage.params is not None
    with pytest.raises(ValidationError, match=r"(?s)colour\n.*Extra inputs are not permitted"):
        node.stage.params.model_validate({**node.params, "colour": "blue"})


@pytest.mark.parametrize("stage", sorted(KINDS - {"gpu-eval", "engine", "ingest"}))
def test_a_missing_param_is_refused_naming_it(stage: str) -> None:
    node = node_of(stage)
    assert node.stage.params is not None
    required = [name for name, f in node.stage.params.model_fields.items() if f.is_required()]
    params = {k: v for k, v in node.params.items() if k != required[0]}
    with pytest.raises(ValidationError, match=rf"(?s){required[0]}\n.*Field required"):
        node.stage.params.model_validate(params)


def test_a_stage_reads_its_params_through_its_record() -> None:
    """A node whose params lost a field is refused where the stage reads them (its hint, its needs), not with a
    KeyError inside it."""
    export = node_of("export")
    bad = replace(export, params={k: v for k, v in export.params.items() if k != "target"})
    with pytest.raises(ValidationError, match=r"(?s)target\n.*Field required"):
        export_stage.hint(bad)
    gptq = next(n for n in planned("tiny-llama", "cpu") if n.id == "quantize/w4a16-gptq")
    uncalibrated: dict[str, Any] = {k: v for k, v in gptq.params.items() if k != "calibration"}
    with pytest.raises(ValidationError, match="calibration.compute_dtype needed"):
        quantize_stage.hint(replace(gptq, params=uncalibrated))
    assert QuantizeParams.model_validate(gptq.params).calibration is not None


def test_a_stage_that_computes_nowhere_else_is_not_placed() -> None:
    """Placement puts the device's kind in the params of the stages whose records hold one; an export's does not."""
    with pytest.raises(ValidationError, match=r"(?s)device\n.*Extra inputs are not permitted"):
        with_device(node_of("export"), planning_device("cuda", "h200"))
