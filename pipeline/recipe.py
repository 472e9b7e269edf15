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
    quantize:                      # optional, per quant: how the scheme is applied
      w4a16-gptq: {lm_head: quantized}   # lm_head kept in bf16 (default) or quantized as the Linears are
    targets:
      - target: gguf
        quants: [f16, q8_0, q4_k_m]
      - target: hf-bundle
        quants: [bf16]
    shape_only: false              # true: `source` holds config.json alone; planned and sized, never built
                                   # (eval.text may then be left out); a source directory found to hold
                                   # config.json and no weights is shape-only without it
    source_copy: false             # true: ingest copies the source into the store (default: links it)

`source` is a directory, `s3://bucket/prefix` (`pipeline.remote_source`) or `hf://ORG/REPO@REVISION`
(`pipeline.hub_source`: fetched into the hub cache and used in place).

Every (target, quant) pair becomes one artifact named "<target>-<quant>".

Paths (`source`, `eval.text`, `calibration.text`) resolve relative to the recipe file's directory
and must stay inside it once symbolic links are resolved, so a recipe from an untrusted change
cannot read `/etc/passwd` as its held-out text. Other directories are allowed only by whoever runs
kiln (`load_recipe(..., allowed_roots=...)`, the CLI's `--allow-outside DIR`), never by the recipe.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.core.datafile import parse_data
from kiln.core.digest import sha256_json
from kiln.core.errors import KilnError, RecipeInvalid
from kiln.core.manifest import ARTIFACT_NAME, MODEL_NAME_PATTERN, VERSION_PATTERN
from kiln.core.untrusted import short_repr
from kiln.eval.reference_rows import MAX_ENTRIES, TAIL_MASS
from kiln.formats.hf_model import is_shape_only
from kiln.pipeline.hub_source import HubSource, is_hub_url
from kiln.quant.schemes import HeadChoice

MAX_RECIPE_BYTES = 1024 * 1024
# Values in a parsed recipe (YAML aliases counted each time they are used) and nesting depth: a
# real recipe has a few hundred values, 6 levels deep.
MAX_RECIPE_VALUES = 100_000
MAX_RECIPE_DEPTH = 32
_RUNNER_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


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
        from kiln.targets.base import get_target

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
    text: str | None = Field(
        default=None, description="held-out text file, relative to the recipe; required unless `shape_only`"
    )
    max_tokens: int = Field(default=4096, ge=64, le=1_000_000)
    window: int = Field(default=256, ge=16, le=32768)
    greedy_prompts: int = Field(default=4, ge=0, le=64)
    greedy_tokens: int = Field(default=32, ge=1, le=1024)
    # How the reference's distributions are stored (eval.reference_rows): the most likely tokens of each
    # position until the rest holds at most `tail_mass`, at most `max_entries` of them.
    tail_mass: float = Field(default=TAIL_MASS, ge=0.0, le=0.5)
    max_entries: int = Field(default=MAX_ENTRIES, ge=1, le=1 << 20)
    gates: dict[str, dict[str, float]] = Field(default_factory=dict)


class CalibrationSettings(_Strict):
    """Calibration text for GPTQ / AWQ: `samples` windows of `seq_len` tokens (see quant.calibrated).

    Without `text`, the eval's held-out text is used after the `eval.max_tokens` tokens the eval
    scores, so calibration never sees the text an artifact is judged on.
    """

    text: str | None = Field(default=None, description="calibration text file, relative to the recipe")
    samples: int = Field(default=32, ge=1, le=4096)
    seq_len: int = Field(default=256, ge=16, le=32768)


class QuantizeOptions(_Strict):
    """How one quant's scheme is applied: `lm_head` kept in bf16 (the default, every preset's) or quantized as the
    decoder's Linears are (by the targets that write it: hf-bundle, rocm-bundle; refused for a tied head)."""

    lm_head: HeadChoice = "kept"


class Recipe(_Strict):
    model: str = Field(pattern=MODEL_NAME_PATTERN)
    version: str = Field(pattern=VERSION_PATTERN)
    source: str
    description: str = ""
    eval: EvalSettings
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings)
    targets: list[TargetEntry] = Field(min_length=1)
    quantize: dict[str, QuantizeOptions] = Field(default_factory=dict)
    # CI runner labels per accelerator ("cpu", "nvidia:h100", ...), for `kiln plan --matrix`; the defaults
    # are pipeline.requirements.RUNNER_LABELS.
    runners: dict[str, list[str]] = Field(default_factory=dict)
    # The source directory holds config.json alone (no weights, no tokenizer): `kiln plan` sizes the release
    # from the model's shape; nothing can be built from it (SOURCE_SHAPE_ONLY).
    shape_only: bool = False
    # Ingest copies the source into the store rather than linking it (a reflink, a hard link, or a reference to
    # the file in place: `storage.links`), for a store that must stand alone.
    source_copy: bool = False
    # Set by parse_recipe from its arguments, never from the recipe's data.
    base_dir: Path = Field(default=Path("."), exclude=True)
    allowed_roots: tuple[Path, ...] = Field(default=(), exclude=True)

    def digest(self) -> str:
        """sha256 of the validated recipe as canonical JSON (defaults filled in, paths as written): what
        the release's provenance names it by (without `quantize` when it sets nothing: digests of recipes written
        before it existed stay what they were)."""
        dumped = self.model_dump(mode="json")
        if not self.quantize:
            dumped.pop("quantize")
        if not self.source_copy:  # how the source is stored, not what is built from it
            dumped.pop("source_copy")
        return sha256_json(dumped)

    def lm_head(self, quant: str) -> HeadChoice:
        """What the recipe does with `lm_head` under `quant`'s scheme."""
        options = self.quantize.get(quant)
        return options.lm_head if options is not None else "kept"

    @field_validator("source")
    @classmethod
    def _no_pickle(cls, v: str) -> str:
        if re.search(r"\.(bin|pt|pth|ckpt|pkl)$", v):
            raise ValueError("source must be a directory of SafeTensors, not a pickle checkpoint")
        return v

    @field_validator("runners")
    @classmethod
    def _runner_labels(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        from kiln.pipeline.requirements import RUNNER_LABELS

        known = ["cpu", *(k for k in RUNNER_LABELS if k is not None)]
        for accelerator, labels in v.items():
            if accelerator not in known:
                raise ValueError(f"runners: unknown accelerator {accelerator!r}; known: {', '.join(known)}")
            if not labels or not all(isinstance(x, str) and _RUNNER_LABEL.fullmatch(x) for x in labels):
                raise ValueError(f"runners.{accelerator}: a non-empty list of runner labels (letters, digits, . _ -)")
        return v

    @model_validator(mode="after")
    def _gates_known(self) -> Recipe:
        from kiln.eval.gates import gate_for
        from kiln.quant.catalog import get_scheme
        from kiln.targets.base import get_target

        used = {q for t in self.targets for q in t.quants}
        for quant, override in self.eval.gates.items():
            if quant not in used:
                raise ValueError(f"eval.gates names quant {quant!r} that no target builds; built: {sorted(used)}")
            _as_value_error(gate_for, quant, override)
        for quant, options in self.quantize.items():
            if quant not in used:
                raise ValueError(f"quantize names quant {quant!r} that no target builds; built: {sorted(used)}")
            _as_value_error(get_scheme, quant, options.lm_head)
            refusing = sorted(
                {t.target for t in self.targets if quant in t.quants and not get_target(t.target).quantized_head}
            )
            if options.lm_head == "quantized" and refusing:
                raise ValueError(
                    f"quantize.{quant}.lm_head: quantized, but {', '.join(refusing)} keep(s) lm_head in bf16; "
                    "build this quant with hf-bundle or rocm-bundle only, or keep lm_head"
                )
        names = [name for name, _, _ in self.artifacts()]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"artifact names repeat: {sorted(dup)}")
        for n in names:
            if not ARTIFACT_NAME.match(n):
                raise ValueError(f"artifact name {n!r} is not valid")
        return self

    @property
    def source_url(self) -> str | None:
        """The source's s3:// URL when it lives in a bucket (`pipeline.remote_source`), else None."""
        return self.source if self.source.startswith("s3://") else None

    @property
    def source_hub(self) -> HubSource | None:
        """The hub repository and revision of an `hf://ORG/REPO@REVISION` source (`pipeline.hub_source`), else None."""
        return HubSource.parse(self.source) if is_hub_url(self.source) else None

    @property
    def source_dir(self) -> Path:
        if self.source_url is not None:
            raise RecipeInvalid(f"source {self.source!r} is a bucket, not a directory")
        if is_hub_url(self.source):
            raise RecipeInvalid(f"source {self.source!r} is a hub repository, not a directory")
        return (self.base_dir / self.source).resolve()

    @property
    def is_shape_only(self) -> bool:
        """The source is config.json alone: `shape_only: true`, or a source directory found to hold config.json
        and no weights. Such a recipe is planned and sized, never built (`pipeline.build.refuse_shape_only`)."""
        if self.shape_only:
            return True
        if self.source_url is not None or is_hub_url(self.source):
            return False
        return is_shape_only(self.source_dir)

    @property
    def eval_text(self) -> Path:
        if self.eval.text is None:  # a shape-only recipe, which is planned but never built
            raise RecipeInvalid("the recipe names no eval.text", details={"field": "eval.text"})
        return (self.base_dir / self.eval.text).resolve()

    @property
    def calibration_text(self) -> Path:
        if self.calibration.text is None:
            return self.eval_text
        return (self.base_dir / self.calibration.text).resolve()

    @property
    def calibration_skip_tokens(self) -> int:
        """Tokens at the start of the calibration text that the eval scores (skipped by calibration)."""
        same = self.calibration.text is None or (self.eval.text is not None and self.calibration_text == self.eval_text)
        return self.eval.max_tokens if same else 0

    def artifacts(self) -> list[tuple[str, TargetEntry, str]]:
        """(artifact name, target entry, quant) for every artifact the recipe builds, in order."""
        return [(f"{t.target}-{q}", t, q) for t in self.targets for q in t.quants]


def _as_value_error(fn: Any, *args: Any) -> Any:
    """Run a lookup that raises KilnError and re-raise it as ValueError so pydantic reports the field."""
    try:
        return fn(*args)
    except KilnError as e:
        raise ValueError(e.message) from None


def load_recipe(path: str | Path, allowed_roots: Iterable[str | Path] = ()) -> Recipe:
    """Read and validate the recipe at `path`; `allowed_roots` are directories outside the recipe's own
    that its paths may point into (from the command line, never from the recipe)."""
    path = Path(path)
    where = {"file": str(path)}
    if not path.exists():
        raise RecipeInvalid(f"recipe {str(path)!r} not found", details=where)
    if not path.is_file():
        raise RecipeInvalid(f"recipe {str(path)!r} is not a regular file", details=where)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise RecipeInvalid(f"recipe {str(path)!r} cannot be read ({e.strerror or e})", details=where) from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeInvalid(f"{path}: larger than the {MAX_RECIPE_BYTES}-byte limit of a recipe", details=where)
    data = parse_data(raw, str(path), RecipeInvalid)
    return parse_recipe(data, base_dir=path.parent, origin=str(path), allowed_roots=allowed_roots)


def parse_recipe(
    data: Any, *, base_dir: Path, origin: str = "recipe", allowed_roots: Iterable[str | Path] = ()
) -> Recipe:
    """Validate recipe data (as parsed from YAML). Paths resolve against `base_dir` and must stay inside it
    or inside one of `allowed_roots`."""
    if not isinstance(data, dict):
        raise RecipeInvalid(f"{origin}: a recipe must be a mapping at the top level")
    _check_size(data, origin)
    internal = sorted(k for k in ("base_dir", "allowed_roots") if k in data)
    if internal:
        raise RecipeInvalid(
            f"{origin}: {internal[0]}: unknown field (directories outside the recipe's are allowed only on the "
            "command line, with --allow-outside DIR)",
            details={"errors": [{"field": k, "message": "unknown field"} for k in internal]},
        )
    roots = tuple(Path(r) for r in allowed_roots)
    try:
        recipe = Recipe.model_validate({**data, "base_dir": base_dir, "allowed_roots": roots})
    except ValidationError as e:
        errors = [_describe(err) for err in e.errors()]
        raise RecipeInvalid(
            f"{origin}: " + "; ".join(f"{loc}: {msg}" for loc, msg in errors),
            details={"errors": [{"field": loc, "message": msg} for loc, msg in errors]},
        ) from None
    remote = recipe.source_url is not None or is_hub_url(recipe.source)
    if recipe.shape_only and remote:
        raise _fail(
            origin, "shape_only", "a shape-only source is a directory holding config.json, not a bucket or a hub"
        )
    fields = [("eval.text", recipe.eval.text, "file")] if recipe.eval.text is not None else []
    if recipe.source_url is not None:
        _check_bucket(origin, recipe.source_url)
    elif is_hub_url(recipe.source):
        try:
            HubSource.parse(recipe.source)
        except KilnError as e:
            raise _fail(origin, "source", e.message) from None
    else:
        _check_path(origin, "source", recipe.source, "directory", base_dir, roots)
    # After the source is checked: whether it is shape-only (config.json alone) is read from its listing.
    if recipe.eval.text is None and not recipe.is_shape_only:
        raise _fail(origin, "eval.text", "required: the held-out text the artifacts are evaluated on")
    if recipe.calibration.text is not None:
        fields.append(("calibration.text", recipe.calibration.text, "file"))
    for name, value, kind in fields:
        _check_path(origin, name, value, kind, base_dir, roots)
    return recipe


def _fail(origin: str, field: str, message: str) -> RecipeInvalid:
    return RecipeInvalid(f"{origin}: {field}: {message}", details={"errors": [{"field": field, "message": message}]})


def _check_path(origin: str, field: str, value: str, kind: str, base_dir: Path, roots: tuple[Path, ...]) -> None:
    """`value` (relative to `base_dir`) must resolve inside `base_dir` or one of `roots`, and exist as `kind`."""
    try:
        if "\x00" in value:
            raise ValueError("embedded NUL")
        base = base_dir.resolve()
        target = (base_dir / value).resolve()
        allowed = [base, *(r.resolve() for r in roots)]
        exists = target.is_dir() if kind == "directory" else target.is_file()
    except (OSError, ValueError, RuntimeError) as e:
        raise _fail(origin, field, f"path {short_repr(value)} cannot be resolved ({e})") from None
    if not any(target.is_relative_to(r) for r in allowed):
        raise _fail(
            origin,
            field,
            f"{short_repr(value)} resolves to {str(target)!r}, outside the recipe's directory {str(base)!r}; "
            "recipe paths must stay inside it (to allow another directory, pass --allow-outside DIR on the "
            "command line)",
        )
    if not exists:
        raise _fail(origin, field, f"{kind} {str(target)!r} does not exist")


def _check_bucket(origin: str, url: str) -> None:
    from kiln.storage.s3 import parse_s3_url

    try:
        _, prefix = parse_s3_url(url)
    except KilnError as e:
        raise _fail(origin, "source", e.message) from None
    if not prefix:
        raise _fail(origin, "source", f"{url!r} names a whole bucket; a source is a prefix (s3://bucket/model/)")


def _check_size(data: Any, origin: str) -> None:
    """Refuse recipes whose parsed value is huge (YAML aliases expand: a "billion laughs") or deep."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_RECIPE_VALUES or depth > MAX_RECIPE_DEPTH:
            raise RecipeInvalid(
                f"{origin}: the recipe has more than {MAX_RECIPE_VALUES} values or is nested deeper than "
                f"{MAX_RECIPE_DEPTH} levels (YAML aliases count each time they are used)"
            )
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in (*value.keys(), *value.values()))
        elif isinstance(value, list | tuple | set):
            stack.extend((v, depth + 1) for v in value)


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
