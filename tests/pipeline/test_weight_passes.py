"""The reference and a transformers eval hold the model as the plan sized them, read its weights a bounded
number of times, and record the passes in their provenance; how they held it changes nothing they made."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.eval.runtimes.residency import Residency
from kiln.pipeline import build
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.store import WorkDir
from tests.model_factory import make_model

GREEDY_TOKENS = 6
LOOSE = {"max_kl": 100.0, "min_top1": 0.0, "max_ppl_increase": 100.0, "min_greedy_match": 0.0}
RUN = ("reference/source", "eval/hf-bundle-bf16")


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("passes")
    make_model(root / "model", hidden_size=128, intermediate_size=256, num_kv_heads=4)
    (root / "heldout.txt").write_text((Path(__file__).parents[1] / "model_factory.py").read_text() * 2)
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {
            "text": "heldout.txt",
            "max_tokens": 256,
            "window": 64,
            "greedy_prompts": 2,
            "greedy_tokens": GREEDY_TOKENS,
            "gates": {"bf16": LOOSE},
        },
        "targets": [{"target": "hf-bundle", "quants": ["bf16"]}],
    }
    (root / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    return root / "kiln.yaml"


def _built(recipe_path: Path, work: Path, held: Residency | None) -> dict[str, dict[str, Any]]:
    """Build the reference and the eval (held as planned, or as `held` says), and read their stage.json."""
    store, recipe = WorkDir(work), load_recipe(recipe_path)
    build.stage_externals(recipe, store)
    nodes = build.plan(recipe, store)
    if held is not None:
        nodes = [
            replace(n, requires=n.requires.model_copy(update={"weights": held})) if n.id in RUN else n for n in nodes
        ]
    wanted = {n.id for n in nodes if n.id in RUN}
    wanted |= {i for n in nodes if n.id in RUN for i in n.inputs.values()}
    wanted |= {i for n in nodes if n.id in wanted for i in n.inputs.values()}
    outcomes = LocalExecutor(store).run([n for n in nodes if n.id in wanted])
    assert {outcomes[i].status for i in RUN} == {"built"}
    stages = {}
    for meta in work.glob("*/*/stage.json"):
        data = json.loads(meta.read_text())
        stages[data["node"]] = data
    return stages


def test_each_stage_records_its_passes_over_the_weights_and_makes_the_same_output(
    recipe_path: Path, tmp_path: Path
) -> None:
    planned = _built(recipe_path, tmp_path / "planned", None)
    # This machine holds the small model whole: one pass each, the eval's greedy agreement teacher-forced.
    for node in RUN:
        weights = planned[node]["provenance"]["resources"]["weights"]
        assert weights["held"] == ["whole"] and weights["passes"] == 1.0, node
    streamed = _built(recipe_path, tmp_path / "streamed", Residency(whole=False))
    # Streamed with nothing resident: the windows' pass, then one per generated token (prefill and n - 1 steps)
    # for the reference.
    reference = streamed["reference/source"]["provenance"]["resources"]["weights"]
    assert reference["held"] == ["streamed by layer"]
    assert GREEDY_TOKENS <= reference["passes"] <= 1 + GREEDY_TOKENS
    # The eval: each layer once, the head (kept by no budget here) once per window and teacher-forced sequence.
    assert streamed["eval/hf-bundle-bf16"]["provenance"]["resources"]["weights"]["passes"] > 1.0
    kept = _built(recipe_path, tmp_path / "kept", Residency(whole=False, resident_bytes=1 << 30))
    for node in RUN:  # the head and every layer kept once read: nothing is read twice
        assert kept[node]["provenance"]["resources"]["weights"]["passes"] <= 1.0, node
    # Whichever way the stages held the model, they made the same outputs under the same keys.
    for node in RUN:
        assert planned[node]["key"] == streamed[node]["key"] == kept[node]["key"], node
        assert planned[node]["result"] == streamed[node]["result"] == kept[node]["result"], node
