"""The target registry: each output format registers itself once, declaring what it supports as data.

Target modules are imported from a fixed list in this file, never from a user-supplied string.
Registering a name twice fails loudly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError, UnknownName
from kiln.core.hardware import PROFILES
from kiln.quant.schemes import Verdict

if TYPE_CHECKING:
    from kiln.formats.architectures.record import Architecture
    from kiln.formats.architectures.shape import ModelShape
    from kiln.formats.hf_model import SourceModel
    from kiln.quant.store import QuantizedWeights
    from kiln.targets.lint.findings import LintReport, LintRequest

# The modules that define kiln's targets; each calls `register` once at import.
BUILTIN_TARGET_MODULES = (
    "kiln.targets.gguf",
    "kiln.targets.hf_bundle",
    "kiln.targets.rocm_bundle",
    "kiln.targets.orbax",
    "kiln.targets.trtllm",
)


@dataclass(frozen=True)
class ExportRequest:
    quant: str
    out_dir: Path  # an empty temporary directory; the stage renames it into place when export returns
    params: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""  # the recipe's model name, for formats that record one (GGUF general.name)
    on_progress: Callable[[int], None] = lambda nbytes: None  # source bytes consumed so far (increment)
    # The shared quantize stage's output for this quant, given exactly when the target lists the quant
    # in `TargetSpec.quantized_input`.
    quantized: QuantizedWeights | None = None
    # What the target's `prepare` computed once for this source (JSON), given when it has one; an export
    # called without it computes the same itself.
    prepared: dict[str, Any] | None = None


@dataclass(frozen=True)
class ExportResult:
    files: list[str]  # paths relative to out_dir, every file the artifact consists of
    runtime: dict[str, Any]  # runtime requirements recorded in the manifest
    details: dict[str, Any] = field(default_factory=dict)  # extra provenance (e.g. fallbacks taken)
    # Hardware this artifact runs on, with the reason for each; None: the target's `hardware` as declared.
    hardware: dict[str, str] | None = None
    # Every hardware profile's verdict for this artifact as written, where it is not the target's source-independent
    # `compatibility` (trtllm: a release's MXFP4 experts narrow its scheme's hardware): the one decision the export
    # stage takes both the hardware (the compatible) and the `unsupported` reasons (the rest) from. Given instead of
    # `hardware`, never with it.
    verdicts: dict[str, Verdict] | None = None
    # The runtimes that serve this artifact and evaluate it, the first the one it was always evaluated
    # with; None: the target's `runtimes_for(quant)`. (A trtllm int4 checkpoint is read by tensorrt_llm
    # only, while its FP8 ones are compressed-tensors that transformers and vLLM read.)
    eval_runtimes: tuple[str, ...] | None = None
    # A pre-quantized source's layout whose stored bytes the artifact keeps, and the one it dequantized tensors of
    # (into bf16, or before quantizing them again); None where it did neither (`SourceUse`).
    passed_through: str | None = None
    dequantized: str | None = None

    def __post_init__(self) -> None:
        if self.verdicts is not None and self.hardware is not None:
            raise ValueError("ExportResult: give verdicts or hardware, not both (hardware is the compatible verdicts)")

    def served(self) -> dict[str, str] | None:
        """The hardware this artifact runs on, with the reason for each (`hardware`, or the compatible `verdicts`);
        None: the target's `hardware` as declared."""
        if self.verdicts is not None:
            return {hw: v.reason for hw, v in self.verdicts.items() if v.compatible}
        return self.hardware


@dataclass(frozen=True)
class BuildRequest:
    """What a derived stage that makes an artifact is given (`DerivedStage.build`): its node's params, the
    ingested source (its directory of files, and the architecture its config.json names), an empty
    directory the artifact's files go into, and a scratch directory removed afterwards."""

    params: dict[str, Any]
    source_dir: Path
    architecture: str
    out_dir: Path
    work_dir: Path


@dataclass(frozen=True)
class DerivedArtifact:
    """What a derived build made (its files are in `BuildRequest.out_dir`) and what its manifest declares:
    the fields of an export's record besides the artifact's name and quant, which are the node's params."""

    target: str
    format: str
    hardware: list[str]
    unsupported: dict[str, str]  # every other hardware profile, with the reason it is not offered there
    runtime: dict[str, Any]  # runtime requirements recorded in the manifest
    runtime_name: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DerivedStage:
    """A stage a target adds per artifact, declared as data and run by the pipeline's derived stage
    (`pipeline.stages.derived`), as the export stage runs `TargetSpec.export`.

    It runs on a GPU runner: its nodes' params name the artifact's `quant`, the GPU's hardware profile
    (`sku`) and, under the runtime's name, the pinned version of `runtime` the runner has
    (`"tensorrt_llm": "1.3.0rc20"`).
    `deferral(params)` says what this machine lacks for that ({"runner", "missing", ...}), or None when
    it can run here. With `build` None it evaluates the artifact's export in `runtime` against the
    reference, judged by the node's gate (a GPU eval per SKU); with `build` it makes an artifact of its
    own from the ingested source (a legacy TensorRT engine per SKU)."""

    kind: str  # the stage's name: in its nodes' ids (`<kind>/<name>`) and cache keys
    code_version: str  # bump when its output for the same input changes; part of the cache key
    description: str
    runtime: str
    deferral: Callable[[dict[str, Any]], dict[str, Any] | None]
    build: Callable[[BuildRequest], DerivedArtifact] | None = None


@dataclass(frozen=True)
class DerivedNode:
    """A node a target adds for one of its artifacts, in a stage of its own: `stage` declares it, `name`
    names the node (`<kind>/<name>`), `params` its params, `inputs` the graph nodes it takes by role
    ("export": the artifact's export, "ingest", "reference"). A node that makes an artifact (a legacy
    TensorRT engine per GPU SKU) has `evaluates` None; one that evaluates the export on other hardware
    (a GPU eval per SKU) names the artifact, and is published with it."""

    stage: DerivedStage
    name: str
    params: dict[str, Any]
    inputs: tuple[str, ...] = ("export",)
    evaluates: str | None = None

    @property
    def kind(self) -> str:
        return self.stage.kind


ExportFn = Callable[["SourceModel", ExportRequest], ExportResult]
# (artifact name, quant, params, the model's shape) -> the artifacts the target derives from that export.
DerivedFn = Callable[[str, str, dict[str, Any], "ModelShape"], list[DerivedNode]]
# source -> what every export of the target needs from it and would otherwise compute once each (JSON).
PrepareFn = Callable[["SourceModel"], dict[str, Any]]
# (quant, params) -> for every hardware profile, whether that artifact runs there and why.
CompatibilityFn = Callable[[str, dict[str, Any]], dict[str, Verdict]]
# An artifact directory (and the model it was made from, when known) -> what is wrong with it (`targets.lint`).
LintFn = Callable[["LintRequest"], "LintReport"]


@dataclass(frozen=True)
class TargetSpec:
    name: str
    format: str
    quants: tuple[str, ...]
    hardware: tuple[str, ...]
    runtime: str  # the runtime eval loads it with first, e.g. "llama.cpp" or "transformers"
    code_version: str  # bump when the output for the same input changes; part of the cache key
    export: ExportFn
    description: str = ""
    # Quants whose export consumes the shared `quantize/<quant>` stage (computed once, used by every target).
    quantized_input: tuple[str, ...] = ()
    # Per-quant hardware verdicts; None: every quant runs on exactly `hardware`.
    compatibility_fn: CompatibilityFn | None = None
    # Validates the recipe's `params` for this target (raises KilnError naming the problem); None: no params.
    check_params: Callable[[dict[str, Any]], None] | None = None
    # Validates `params` for one quant (e.g. an engine SKU that cannot run that scheme); None: nothing to check.
    check_quant_params: Callable[[str, dict[str, Any]], None] | None = None
    # Schemes the target refuses, with the reason the recipe error gives.
    unsupported_quants: dict[str, str] = field(default_factory=dict)
    # Nodes a target adds per artifact (GPU evals per SKU, legacy engines); None: the export is the only one.
    derived: DerivedFn | None = None
    # Work shared by all the target's exports of one source, done once by the target's prepare stage.
    prepare: PrepareFn | None = None
    # The other runtimes that serve the target's artifacts, each evaluating them beside `runtime` (vLLM
    # for the HF-format bundles); what a runtime cannot run on this machine it records as not evaluated.
    serving_runtimes: tuple[str, ...] = ()
    # Quants served by other runtimes than those (trtllm's int4 checkpoints: tensorrt_llm only), all listed.
    quant_runtimes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Whether the target writes each family through the family's own mapping in its architecture record
    # (`formats.architectures`, `Architecture.targets[name]`): a family whose record refuses the target is
    # refused at plan time with the record's reason. False: the target writes any family's tensors as they are.
    per_architecture: bool = False
    # Refuses, at plan time, a model of a family the record maps that this target still cannot write or serve in
    # one quant (a config feature its runtime does not compute, a scheme its family's loader cannot read, a mesh
    # the model does not split over, an engine no pinned release converts): called with the model's shape, its
    # config.json, the quant and the recipe's params, raising KilnError with the reason. None: nothing to check.
    check_model_fn: Callable[[ModelShape, Mapping[str, Any], str, dict[str, Any]], None] | None = None
    # Refuses, at plan time, a source whose own files beyond config.json (its tokenizer) this target cannot write:
    # the check its prepare or export stage makes on them, called once per target with the source as the plan read
    # it (a shape-only source has none), raising KilnError with the reason. None: nothing to check.
    check_source_fn: Callable[[SourceModel], None] | None = None
    # Checks an artifact of this target against what its runtime loads, without running a model (`targets.lint`:
    # one checker per format); the export stage fails on an error it finds, and publish refuses the artifact.
    lint: LintFn | None = None
    # Whether it writes `lm_head` quantized where the recipe asks (`quantize.<quant>.lm_head: quantized`); a recipe
    # asking it of a target that does not is refused.
    quantized_head: bool = False
    # What its export holds while it writes, in copies of the source's largest tensor (beyond its imports), by
    # quant ("*": any other), as measured (bench/results/scale.jsonl at Llama-3-8B's shape); the plan sizes
    # the export stage with it (`pipeline.requirements`).
    export_tensor_copies: Mapping[str, float] = field(default_factory=lambda: {"*": 4.0})

    def export_copies(self, quant: str) -> float:
        """`export_tensor_copies` for `quant`."""
        return self.export_tensor_copies.get(quant, self.export_tensor_copies["*"])

    def runtimes_for(self, quant: str) -> tuple[str, ...]:
        """The runtimes that evaluate this target's artifact for `quant`, the first its primary."""
        return self.quant_runtimes.get(quant, (self.runtime, *self.serving_runtimes))

    def compatibility(self, quant: str, params: dict[str, Any] | None = None) -> dict[str, Verdict]:
        """For every hardware profile: whether this target's artifact for `quant` runs there, and why."""
        if self.compatibility_fn is not None:
            return self.compatibility_fn(quant, params or {})
        return {
            hw: Verdict(compatible=True, reason=f"{self.runtime} on {hw}")
            if hw in self.hardware
            else Verdict(compatible=False, reason=f"{self.name} artifacts run on {', '.join(self.hardware)}")
            for hw in PROFILES
        }

    def check_hardware(self, quant: str, params: dict[str, Any], hardware: list[str]) -> None:
        """Refuse hardware the artifact for `quant` cannot serve, naming the hardware and the reason."""
        verdicts = self.compatibility(quant, params)
        for hw in hardware:
            if hw not in verdicts:
                raise UnknownName(
                    f"unknown hardware {hw!r}; known: {', '.join(verdicts)}", details={"known": list(verdicts)}
                )
            if not verdicts[hw].compatible:
                raise KilnError(
                    f"{self.name}-{quant} cannot serve {hw}: {verdicts[hw].reason}",
                    code=Codes.HARDWARE_INCOMPATIBLE,
                    details={"artifact": f"{self.name}-{quant}", "hardware": hw, "reason": verdicts[hw].reason},
                )

    def check_architecture(self, arch: Architecture) -> None:
        """TARGET_ARCHITECTURE_UNSUPPORTED when the family's record says this target cannot serve it, and why."""
        if not self.per_architecture:
            return
        mapping = arch.target(self.name)
        if mapping.refused is not None:
            raise InvalidInput(
                f"target {self.name!r} cannot serve {arch.hf_class} ({arch.family}): {mapping.refused}",
                code=Codes.TARGET_ARCHITECTURE_UNSUPPORTED,
                details={"target": self.name, "architecture": arch.hf_class, "reason": mapping.refused},
            )

    def check_model(self, shape: ModelShape, config: Mapping[str, Any], quant: str, params: dict[str, Any]) -> None:
        """Refuse, at plan time, a model this target cannot serve in `quant`: its family (`check_architecture`),
        then the model itself (`check_model_fn`), each with the reason."""
        self.check_architecture(shape.arch)
        if self.check_model_fn is not None:
            self.check_model_fn(shape, config, quant, params)

    def check_source(self, source: SourceModel) -> None:
        """Refuse, at plan time, a source whose files this target cannot write (`check_source_fn`), with the reason."""
        if self.check_source_fn is not None:
            self.check_source_fn(source)

    def check_quant(self, quant: str) -> None:
        if quant in self.unsupported_quants:
            raise InvalidInput(
                f"target {self.name!r} refuses quant {quant!r}: {self.unsupported_quants[quant]}",
                code=Codes.QUANT_UNSUPPORTED,
                details={"target": self.name, "quant": quant, "reason": self.unsupported_quants[quant]},
            )
        if quant not in self.quants:
            raise UnknownName(
                f"target {self.name!r} does not support quant {quant!r}; supported: {', '.join(self.quants)}",
                details={"target": self.name, "known": list(self.quants)},
            )


_REGISTRY: dict[str, TargetSpec] = {}


def register(spec: TargetSpec) -> TargetSpec:
    if spec.name in _REGISTRY:
        raise KilnError(f"target {spec.name!r} is registered twice", code=Codes.TARGET_REGISTERED_TWICE)
    _REGISTRY[spec.name] = spec
    return spec


def _load_builtin() -> None:
    for module in BUILTIN_TARGET_MODULES:
        spec = getattr(importlib.import_module(module), "SPEC", None)
        if not isinstance(spec, TargetSpec) or _REGISTRY.get(spec.name) is not spec:
            raise KilnError(f"target module {module} did not register its SPEC", code=Codes.TARGET_NOT_REGISTERED)


def all_targets() -> dict[str, TargetSpec]:
    _load_builtin()
    return dict(_REGISTRY)


def get_target(name: str) -> TargetSpec:
    targets = all_targets()
    if name not in targets:
        raise UnknownName(
            f"unknown target {name!r}; known: {', '.join(sorted(targets))}", details={"known": sorted(targets)}
        )
    return targets[name]
