"""The recipe (kiln.yaml): what to build from one model release, validated with errors that point at the field.

    model: tiny-llama
    version: 1.0.0
    source: model                  # directory, relative to the recipe file
    eval:
      text: heldout.txt            # held-out text shipped with the model
      max_tokens: 4096
      gates:                       # per-quant overrides of eval.gates defaults
        q4_0: {max_kl: 0.2}
    calibration:                   # optional; for calibrated schemes (w4a16-gptq, w4a16-awq)
      text: calib.txt              # default: eval.text, minus the tokens the eval scores
      samples: 32
      seq_len: 256
    targets:
      - target: gguf
        quants: [f16, q8_0, q4_k_m]
      - target: hf-bundle
        quants: [bf16]

Every (target, quant) pair becomes one artifact named "<target>-<quant>".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.errors import KilnError, RecipeInvalid
from kiln.manifest import ARTIFACT_NAME

_MODEL_NAME = r"^[a-z0-9][a-z0-9._-]{0,63}$"
_VERSION = r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}$"


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TargetEntry(_Strict):
    target: str
    quants: list[str] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    # Only these hardware profiles: each must be able to serve every quant, and the artifacts are
    # offered to these alone. None: every profile the artifact runs on.
    hardware: list[str] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _known(self) -> TargetEntry:
        from targets.base import get_target

        spec = _as_value_error(get_target, self.target)
        for q in self.quants:
            _as_value_error(spec.check_quant, q)
        if len(set(self.quants)) != len(self.quants):
            raise ValueError(f"quants list repeats a name: {self.quants}")
        if spec.check_params is not None:
            _as_value_error(spec.check_params, self.params)
        if spec.check_quant_params is not None:
            for q in self.quants:
                _as_value_error(spec.check_quant_params, q, self.params)
        for q in self.quants:
            if self.hardware is not None:
                _as_value_error(spec.check_hardware, q, self.params, self.hardware)
            elif not any(v.compatible for v in spec.compatibility(q, self.params).values()):
                raise ValueError(f"{self.target}-{q} runs on no known hardware")
        return self


class EvalSettings(_Strict):
    text: str = Field(description="held-out text file, relative to the recipe")
    max_tokens: int = Field(default=4096, ge=64, le=1_000_000)
    window: int = Field(default=256, ge=16, le=32768)
    greedy_prompts: int = Field(default=4, ge=0, le=64)
    greedy_tokens: int = Field(default=32, ge=1, le=1024)
    gates: dict[str, dict[str, float]] = Field(default_factory=dict)


class CalibrationSettings(_Strict):
    """Calibration text for GPTQ / AWQ: `samples` windows of `seq_len` tokens (see pipeline.quantize.calibrated).

    Without `text`, the eval's held-out text is used after the `eval.max_tokens` tokens the eval
    scores, so calibration never sees the text an artifact is judged on.
    """

    text: str | None = Field(default=None, description="calibration text file, relative to the recipe")
    samples: int = Field(default=32, ge=1, le=4096)
    seq_len: int = Field(default=256, ge=16, le=32768)


class Recipe(_Strict):
    model: str = Field(pattern=_MODEL_NAME)
    version: str = Field(pattern=_VERSION)
    source: str
    description: str = ""
    eval: EvalSettings
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings)
    targets: list[TargetEntry] = Field(min_length=1)
    base_dir: Path = Field(default=Path("."), exclude=True)

    @field_validator("source")
    @classmethod
    def _no_pickle(cls, v: str) -> str:
        if re.search(r"\.(bin|pt|pth|ckpt|pkl)$", v):
            raise ValueError("source must be a directory of SafeTensors, not a pickle checkpoint")
        return v

    @model_validator(mode="after")
    def _gates_known(self) -> Recipe:
        from eval.gates import gate_for

        used = {q for t in self.targets for q in t.quants}
        for quant, override in self.eval.gates.items():
            if quant not in used:
                raise ValueError(f"eval.gates names quant {quant!r} that no target builds; built: {sorted(used)}")
            _as_value_error(gate_for, quant, override)
        names = [name for name, _, _ in self.artifacts()]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"artifact names repeat: {sorted(dup)}")
        for n in names:
            if not ARTIFACT_NAME.match(n):
                raise ValueError(f"artifact name {n!r} is not valid")
        return self

    @property
    def source_dir(self) -> Path:
        return (self.base_dir / self.source).resolve()

    @property
    def eval_text(self) -> Path:
        return (self.base_dir / self.eval.text).resolve()

    @property
    def calibration_text(self) -> Path:
        return (self.base_dir / (self.calibration.text or self.eval.text)).resolve()

    @property
    def calibration_skip_tokens(self) -> int:
        """Tokens at the start of the calibration text that the eval scores (skipped by calibration)."""
        return self.eval.max_tokens if self.calibration_text == self.eval_text else 0

    def artifacts(self) -> list[tuple[str, TargetEntry, str]]:
        """(artifact name, target entry, quant) for every artifact the recipe builds, in order."""
        return [(f"{t.target}-{q}", t, q) for t in self.targets for q in t.quants]


def _as_value_error(fn: Any, *args: Any) -> Any:
    """Run a lookup that raises KilnError and re-raise it as ValueError so pydantic reports the field."""
    try:
        return fn(*args)
    except KilnError as e:
        raise ValueError(e.message) from None


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeInvalid(f"recipe {str(path)!r} not found", details={"file": str(path)})
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise RecipeInvalid(f"{path}: not valid YAML: {e}", details={"file": str(path)}) from None
    return parse_recipe(data, base_dir=path.parent, origin=str(path))


def parse_recipe(data: Any, *, base_dir: Path, origin: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeInvalid(f"{origin}: a recipe must be a mapping at the top level")
    try:
        recipe = Recipe.model_validate({**data, "base_dir": base_dir})
    except ValidationError as e:
        errors = [_describe(err) for err in e.errors()]
        raise RecipeInvalid(
            f"{origin}: " + "; ".join(f"{loc}: {msg}" for loc, msg in errors),
            details={"errors": [{"field": loc, "message": msg} for loc, msg in errors]},
        ) from None
    if not recipe.source_dir.is_dir():
        raise RecipeInvalid(
            f"{origin}: source: directory {str(recipe.source_dir)!r} does not exist",
            details={"errors": [{"field": "source", "message": "directory does not exist"}]},
        )
    if not recipe.eval_text.is_file():
        raise RecipeInvalid(
            f"{origin}: eval.text: file {str(recipe.eval_text)!r} does not exist",
            details={"errors": [{"field": "eval.text", "message": "file does not exist"}]},
        )
    if not recipe.calibration_text.is_file():
        raise RecipeInvalid(
            f"{origin}: calibration.text: file {str(recipe.calibration_text)!r} does not exist",
            details={"errors": [{"field": "calibration.text", "message": "file does not exist"}]},
        )
    return recipe


def _describe(err: Any) -> tuple[str, str]:
    loc = ""
    for part in err["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    return loc or "recipe", msg
