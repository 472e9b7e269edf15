"""`lm_head` kept in bf16 (every preset) or quantized like the decoder's Linears, by the recipe's explicit choice
(`quantize.<quant>.lm_head`): validated where the recipe is read, refused for a tied head and for targets that do
not write it, and a bundle transformers loads whose `quantization_config` names the head among its targets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from kiln.core.errors import InvalidInput, KilnError, RecipeInvalid
from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
from kiln.pipeline.build import plan
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.store import WorkDir
from kiln.quant.catalog import SCHEMES, get_scheme
from kiln.quant.footprint import checkpoint_bytes
from kiln.quant.rtn import HeadTied, quantizes
from kiln.quant.schemes import Scheme
from tests.model_factory import make_bundle, make_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3"), "qwen3", hidden_size=128, intermediate_size=256, vocab_size=384)


def test_every_preset_keeps_the_head_and_the_choice_is_data() -> None:
    for name, scheme in SCHEMES.items():
        assert scheme.lm_head == "kept" and not quantizes(scheme, "lm_head.weight"), name
    head = get_scheme("int4-rtn", "quantized")
    assert head.lm_head == "quantized" and quantizes(head, "lm_head.weight")
    assert head.targets == ("Linear", "lm_head") and "lm_head" not in head.ignore
    assert head.with_lm_head("kept") == get_scheme("int4-rtn")
    with pytest.raises(InvalidInput) as e:
        get_scheme("bf16", "quantized")
    assert e.value.code == "QUANT_HEAD_UNSUPPORTED"
    with pytest.raises(ValueError, match="either ignored"):  # the data cannot say both
        Scheme.model_validate({**get_scheme("fp8").model_dump(), "targets": ["Linear", "lm_head"]})


@pytest.mark.parametrize("scheme", ["int4-rtn", "fp8", pytest.param("w4a16-gptq", marks=pytest.mark.slow)])
def test_a_quantized_head_is_stored_quantized_and_loads(scheme: str, qwen3: Path, tmp_path: Path) -> None:
    kept = make_bundle(qwen3, tmp_path / "kept", scheme)
    head = make_bundle(qwen3, tmp_path / "head", scheme, lm_head="quantized")
    config = json.loads((head / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == [] and config["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"]
    from safetensors import safe_open

    with safe_open(str(head / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
    assert "lm_head.weight_scale" in stored and stored.get("lm_head.weight") != "BF16"  # FP8 keeps `weight`
    written = (head / "model.safetensors").stat().st_size
    assert written < (kept / "model.safetensors").stat().st_size
    header = int.from_bytes((head / "model.safetensors").read_bytes()[:8], "little")
    source_config = json.loads((qwen3 / "config.json").read_text())
    assert checkpoint_bytes(source_config, scheme, "quantized") == written - 8 - header
    ids = list(range(1, 380, 3))
    ref = TransformersRuntime(qwen3).logits(ids)
    logits = {p: TransformersRuntime(p).logits(ids) for p in (kept, head)}
    rel = {p: float(np.linalg.norm(lg - ref) / np.linalg.norm(ref)) for p, lg in logits.items()}
    assert rel[head] < 0.45 and rel[head] != rel[kept]  # transformers computes with the quantized head


def test_a_tied_head_is_refused(tmp_path: Path) -> None:
    gemma = make_model(tmp_path / "gemma3", "gemma3", hidden_size=128, intermediate_size=256, vocab_size=384)
    with pytest.raises(HeadTied) as e:
        make_bundle(gemma, tmp_path / "out", "int4-rtn", lm_head="quantized")
    assert e.value.code == "QUANT_HEAD_TIED"
    with pytest.raises(HeadTied):
        checkpoint_bytes(json.loads((gemma / "config.json").read_text()), "int4-rtn", "quantized")


RECIPE = {
    "model": "tiny",
    "version": "1.0.0",
    "source": "model",
    "eval": {"text": "heldout.txt"},
    "targets": [{"target": "hf-bundle", "quants": ["int4-rtn", "fp8"]}],
}


def _recipe(tmp_path: Path, data: dict, family: str = "qwen3") -> Path:
    if not (tmp_path / "model").exists():
        make_model(tmp_path / "model", family, hidden_size=128, intermediate_size=256, vocab_size=384)
    (tmp_path / "heldout.txt").write_text("def f():\n    return 1\n")
    path = tmp_path / "kiln.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_recipe_chooses_per_quant_and_the_plan_quantizes_accordingly(tmp_path: Path) -> None:
    plain = load_recipe(_recipe(tmp_path, RECIPE))
    assert plain.lm_head("int4-rtn") == "kept"
    recipe = load_recipe(_recipe(tmp_path, {**RECIPE, "quantize": {"int4-rtn": {"lm_head": "quantized"}}}))
    assert recipe.digest() != plain.digest()
    nodes = {n.id: n for n in plan(recipe, WorkDir(tmp_path / "work"))}
    assert nodes["quantize/int4-rtn"].params["scheme"]["targets"] == ["Linear", "lm_head"]
    assert nodes["quantize/fp8"].params["scheme"] == get_scheme("fp8").model_dump(mode="json")
    before = {n.id: n for n in plan(plain, WorkDir(tmp_path / "work"))}
    assert before["quantize/int4-rtn"].params["scheme"] == get_scheme("int4-rtn").model_dump(mode="json")


@pytest.mark.parametrize(
    ("quantize", "targets", "expect"),
    [
        ({"int4-rtn": {"lm_head": "both"}}, None, "lm_head"),
        ({"q4_0": {"lm_head": "quantized"}}, None, "no target builds"),
        ({"int4-rtn": {"lm_head": "quantized", "bits": 4}}, None, "bits"),
        ({"bf16": {"lm_head": "quantized"}}, [{"target": "hf-bundle", "quants": ["bf16"]}], "quantizes nothing"),
        (
            {"fp8": {"lm_head": "quantized"}},
            [{"target": "hf-bundle", "quants": ["fp8"]}, {"target": "trtllm", "quants": ["fp8"]}],
            "trtllm keep(s) lm_head",
        ),
    ],
)
def test_a_bad_choice_is_refused_naming_it(tmp_path: Path, quantize: dict, targets: list | None, expect: str) -> None:
    data = {**RECIPE, "quantize": quantize, **({"targets": targets} if targets else {})}
    with pytest.raises(RecipeInvalid) as e:
        load_recipe(_recipe(tmp_path, data))
    assert "quantize" in e.value.message and expect in e.value.message, e.value.message


def test_a_tied_head_is_refused_at_plan_time(tmp_path: Path) -> None:
    data = {**RECIPE, "quantize": {"int4-rtn": {"lm_head": "quantized"}}}
    recipe = load_recipe(_recipe(tmp_path, data, family="gemma3"))
    with pytest.raises(KilnError) as e:
        plan(recipe, WorkDir(tmp_path / "work"))
    assert e.value.code == "QUANT_HEAD_TIED" and "int4-rtn" in e.value.message


def test_rocm_bundle_writes_a_quantized_head_in_e4m3fnuz_for_gfx942(qwen3: Path, tmp_path: Path) -> None:
    """rocm-bundle takes the same quantize output; for gfx942 its FP8 head is pre-converted with the rest."""
    params = {"gfx_arch": "gfx942", "vllm": "0.11.2", "rocm": "7.0.2", "fp8_dtype": "e4m3fnuz"}
    bundle = make_bundle(qwen3, tmp_path, "fp8", "rocm-bundle", params, lm_head="quantized")
    from safetensors import safe_open

    with safe_open(str(bundle / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == "F8_E4M3FNUZ"
    ids = list(range(1, 380, 3))
    ref = TransformersRuntime(qwen3).logits(ids)
    got = TransformersRuntime(bundle).logits(ids)
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 0.12
