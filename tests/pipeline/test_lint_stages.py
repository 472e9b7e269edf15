"""The lint where artifacts are made and published: an export whose artifact has a faulty scale fails naming
the tensor and stores nothing; a passing export records its lint; publish refuses a failing artifact before
anything reaches the registry."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml

from kiln.pipeline import build
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.records import ArtifactRecord
from kiln.pipeline.stage import StageContext
from kiln.pipeline.stages import publish
from kiln.pipeline.store import WorkDir
from kiln.targets.lint import ArtifactLintFailed
from tests.model_factory import make_model

POISONED = "model.layers.1.mlp.down_proj.weight"


def _recipe(root: Path, poison: bool) -> Path:
    make_model(root / "model")
    if poison:  # one weight overflowed in training: its round-to-nearest scale is infinite too
        from safetensors.torch import load_file, save_file

        tensors = load_file(root / "model" / "model.safetensors")
        tensors[POISONED][5, 7] = float("inf")
        save_file(tensors, root / "model" / "model.safetensors", metadata={"format": "pt"})
    (root / "heldout.txt").write_text("def f(x):\n    return [x, x + 1, str(x)]\n" * 40)
    doc = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt", "max_tokens": 128, "window": 64},
        "targets": [{"target": "hf-bundle", "quants": ["fp8"]}, {"target": "gguf", "quants": ["q8_0"]}],
    }
    (root / "kiln.yaml").write_text(yaml.safe_dump(doc))
    return root / "kiln.yaml"


def test_export_of_an_artifact_with_an_infinite_scale_fails_naming_it(tmp_path: Path) -> None:
    recipe = load_recipe(_recipe(tmp_path, poison=True))
    store = WorkDir(tmp_path / "work")
    for stage in ("ingest/source", "quantize/fp8", "prepare/gguf"):
        build.run_one(recipe, store, stage)
    for stage, code, tensor in [
        ("export/hf-bundle-fp8", "SCALE_INF", "model.layers.1.mlp.down_proj.weight_scale"),
        ("export/gguf-q8_0", "SCALE_INF", "blk.1.ffn_down.weight"),
    ]:
        with pytest.raises(ArtifactLintFailed) as failed:
            build.run_one(recipe, store, stage)
        assert failed.value.code == code and failed.value.details["tensor"] == tensor
        assert f"{stage}: lint {code} {tensor}" in failed.value.message
    assert not list((tmp_path / "work").glob("export/*/files"))  # nothing stored for either


def test_publish_refuses_a_failing_artifact_before_uploading(tmp_path: Path) -> None:
    recipe = load_recipe(_recipe(tmp_path, poison=False))
    store = WorkDir(tmp_path / "work")
    ingest = build.run_one(recipe, store, "ingest/source").output
    build.run_one(recipe, store, "quantize/fp8")
    export = build.run_one(recipe, store, "export/hf-bundle-fp8").output
    assert ingest is not None and export is not None
    assert export.record(ArtifactRecord).details["lint"] == {"errors": 0, "warnings": {}, "tensors": 35, "scales": 14}

    # The same artifact as a shared store might hand it over: one expert-less scale turned NaN.
    copy = tmp_path / "tampered"
    shutil.copytree(export.path, copy)
    from safetensors.torch import load_file, save_file

    shard = copy / "files" / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.o_proj.weight_scale"][2, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    registry = tmp_path / "registry"
    node = next(n for n in build.plan(recipe, store, registry=str(registry)) if n.id == "publish/hf-bundle-fp8")
    ctx = StageContext(
        node=node,
        out_dir=tmp_path / "out",
        inputs={"ingest": ingest, "artifact": dataclasses.replace(export, path=copy)},
    )
    with pytest.raises(ArtifactLintFailed) as refused:
        publish.run(ctx)
    assert refused.value.code == "SCALE_NAN"
    assert refused.value.details["tensor"] == "model.layers.0.self_attn.o_proj.weight_scale"
    assert not registry.exists()  # refused before the registry was opened
