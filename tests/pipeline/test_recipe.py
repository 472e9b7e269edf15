"""Recipe validation: every bad field gets an error that points at it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kiln.core.errors import RecipeInvalid
from kiln.pipeline.recipe import load_recipe

GOOD = {
    "model": "tiny",
    "version": "1.0.0",
    "source": "model",
    "eval": {"text": "heldout.txt"},
    "targets": [{"target": "gguf", "quants": ["f16", "q8_0"]}, {"target": "hf-bundle", "quants": ["bf16"]}],
}


def _write(tmp_path: Path, data: object) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "heldout.txt").write_text("def f():\n    return 1\n")
    path = tmp_path / "kiln.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _error(tmp_path: Path, data: object) -> RecipeInvalid:
    with pytest.raises(RecipeInvalid) as info:
        load_recipe(_write(tmp_path, data))
    return info.value


def test_good_recipe_names_one_artifact_per_target_and_quant(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, GOOD))
    assert [name for name, _, _ in recipe.artifacts()] == ["gguf-f16", "gguf-q8_0", "hf-bundle-bf16"]
    assert recipe.source_dir == (tmp_path / "model").resolve()


def test_unknown_target_lists_known_ones(tmp_path: Path) -> None:
    e = _error(tmp_path, {**GOOD, "targets": [{"target": "onnx", "quants": ["f16"]}]})
    assert "targets[0]" in e.message and "known: gguf, hf-bundle" in e.message


def test_unknown_quant_points_at_the_list_entry(tmp_path: Path) -> None:
    e = _error(tmp_path, {**GOOD, "targets": [{"target": "gguf", "quants": ["q3_k"]}]})
    assert "targets[0]" in e.message and "q3_k" in e.message and "q4_k_m" in e.message


def test_unknown_field_is_named(tmp_path: Path) -> None:
    e = _error(tmp_path, {**GOOD, "sorce": "model"})
    assert "sorce: unknown field" in e.message
    assert e.details["errors"][0]["field"] == "sorce"


def test_bad_version_and_model_name(tmp_path: Path) -> None:
    e = _error(tmp_path, {**GOOD, "model": "Bad Name", "version": "../1"})
    fields = {err["field"] for err in e.details["errors"]}
    assert fields == {"model", "version"}


def test_gate_override_with_unknown_key_is_refused(tmp_path: Path) -> None:
    e = _error(tmp_path, {**GOOD, "eval": {"text": "heldout.txt", "gates": {"q8_0": {"max_kld": 0.1}}}})
    assert "eval" in e.message and "max_kld" in e.message


def test_gate_for_a_quant_no_target_builds_is_refused(tmp_path: Path) -> None:
    e = _error(tmp_path, {**GOOD, "eval": {"text": "heldout.txt", "gates": {"q4_0": {"max_kl": 0.1}}}})
    assert "q4_0" in e.message


def test_missing_source_dir_and_text(tmp_path: Path) -> None:
    path = _write(tmp_path, {**GOOD, "source": "nowhere"})
    with pytest.raises(RecipeInvalid, match="source: directory"):
        load_recipe(path)
    path = _write(tmp_path, {**GOOD, "eval": {"text": "missing.txt"}})
    with pytest.raises(RecipeInvalid, match="eval.text"):
        load_recipe(path)


def test_not_yaml_and_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed")
    with pytest.raises(RecipeInvalid, match="not valid YAML"):
        load_recipe(path)
    with pytest.raises(RecipeInvalid, match="mapping"):
        load_recipe(_write(tmp_path, ["a", "b"]))


def test_pickle_source_is_refused(tmp_path: Path) -> None:
    e = _error(tmp_path, {**GOOD, "source": "model/pytorch_model.bin"})
    assert "pickle" in e.message


# --- paths stay inside the recipe's directory unless the command line allows another ------------------------


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"eval": {"text": "/etc/passwd"}}, "eval.text"),
        ({"eval": {"text": "../../../../../../etc/passwd"}}, "eval.text"),
        ({"source": "/etc"}, "source"),
        ({"source": "model/../.."}, "source"),
        ({"calibration": {"text": "/etc/hostname"}}, "calibration.text"),
    ],
)
def test_paths_outside_the_recipe_directory_are_refused(tmp_path: Path, edit: dict, field: str) -> None:
    e = _error(tmp_path, {**GOOD, **edit})
    assert e.message.startswith(f"{tmp_path / 'kiln.yaml'}: {field}: ")
    assert "outside the recipe's directory" in e.message and "--allow-outside" in e.message
    assert e.details["errors"] == [{"field": field, "message": e.message.split(f"{field}: ", 1)[1]}]


def test_a_symlink_leaving_the_recipe_directory_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "text.txt").write_text("secret")
    recipe_dir = tmp_path / "r"
    recipe_dir.mkdir()
    (recipe_dir / "held.txt").symlink_to(outside / "text.txt")
    path = _write(recipe_dir, {**GOOD, "eval": {"text": "held.txt"}})
    with pytest.raises(RecipeInvalid, match=r"eval.text: 'held.txt' resolves to .*outside the recipe's directory"):
        load_recipe(path)
    recipe = load_recipe(path, allowed_roots=[outside])  # the command line may allow it
    assert recipe.eval_text == (outside / "text.txt").resolve()
    (recipe_dir / "inside.txt").symlink_to(recipe_dir / "heldout.txt")  # a link that stays inside is fine
    assert load_recipe(_write(recipe_dir, {**GOOD, "eval": {"text": "inside.txt"}})).eval.text == "inside.txt"


def test_the_recipe_cannot_allow_directories_itself(tmp_path: Path) -> None:
    for key, value in (("allowed_roots", ["/"]), ("base_dir", "/")):
        e = _error(tmp_path, {**GOOD, key: value, "eval": {"text": "/etc/passwd"}})
        assert f"{key}: unknown field" in e.message and "command line" in e.message


@pytest.mark.parametrize("value", ["model\x00x", "a" * 5000, "\udcff"])
def test_unresolvable_paths_are_recipe_errors(tmp_path: Path, value: str) -> None:
    from kiln.pipeline.recipe import parse_recipe

    (tmp_path / "heldout.txt").write_text("x")
    with pytest.raises(RecipeInvalid, match="source: "):
        parse_recipe({**GOOD, "source": value}, base_dir=tmp_path)


# --- the YAML itself --------------------------------------------------------------------------------------------


def test_yaml_bombs_and_deep_nesting_are_refused(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
    )
    path = tmp_path / "bomb.yaml"
    path.write_text("model: tiny\nversion: '1'\nsource: model\n" + laughs)
    with pytest.raises(RecipeInvalid, match="more than 100000 values"):
        load_recipe(path)
    path.write_text("model: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(RecipeInvalid, match="nested too deeply|deeper than"):
        load_recipe(path)
    path.write_text("a: &a [*a]\n")  # refers to itself
    with pytest.raises(RecipeInvalid):
        load_recipe(path)


def test_unreadable_recipes_are_recipe_errors(tmp_path: Path) -> None:
    path = tmp_path / "kiln.yaml"
    path.write_bytes(b"model: \xff\xfe\n")
    with pytest.raises(RecipeInvalid, match="not UTF-8"):
        load_recipe(path)
    path.write_bytes(b"# " + b"x" * (1024 * 1024 + 1))
    with pytest.raises(RecipeInvalid, match="limit"):
        load_recipe(path)
    with pytest.raises(RecipeInvalid, match="not a regular file"):
        load_recipe(tmp_path)
