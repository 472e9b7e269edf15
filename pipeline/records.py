"""What each stage hands the next: frozen, validated records, one type per stage, stored in `stage.json`; and
what each stage is given: its node's params, one record per stage kind.

A stage returns its record; the executor writes `record.model_dump(mode="json")` as the output's
`result` (with the record's name) and reads it back through the same type, so a consumer gets typed
fields (`ingest.result.source_digest`), never a string-keyed dict, and a `stage.json` that does not
match its schema is an error, not a KeyError three stages later.

The eval stage's record is `core.evals.EvalReport`; the publish stage sends it to the registry as a
`core.evals.PublishedEval`.

A node's params cross processes as JSON (`kiln run-stage`, a Ray task) and are hashed into its cache key.
The planner makes them from the stage kind's params record (`StageParams.as_params`) and the stage reads
them back through it (`XParams.model_validate(node.params)`), so a param the record does not know, or one
it needs and does not find, is refused with the field named, never a KeyError inside the stage. An optional
param left unset is left out of the JSON (`StageParams.absent_when_default`), so a param added to a record
later leaves every existing key as it was.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from kiln.core.device import DeviceKind
from kiln.core.evals import Gate
from kiln.core.manifest import ArtifactIdentity, FileEntry
from kiln.core.shape import ShapeRecord
from kiln.eval.reference_rows import MAX_ENTRIES, TAIL_MASS
from kiln.eval.runtimes.capabilities import VllmCapabilities
from kiln.formats.prequantized import QuantizationRecord
from kiln.quant.schemes import Scheme


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class IgnoredFile(Record):
    path: str
    reason: str


class IngestRecord(Record):
    """The checked source release, copied into the store."""

    source_digest: str
    source_files: list[FileEntry]
    shape: ShapeRecord = Field(description="what the registry keeps to size KV caches (a release's model_config)")
    architecture: str
    tensors: int
    parameters: int
    ignored: list[IgnoredFile] = Field(description="files left alone (pickles beside SafeTensors, ...)")
    quantization: QuantizationRecord | None = Field(
        default=None, description="a pre-quantized release's layout, checked (formats.prequantized); None: plain"
    )

    @model_serializer(mode="wrap")
    def _plain_sources_unchanged(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `quantization` key for a plain source: its record, and so its output's digest and every cache key
        downstream, stay what they were before sources could be quantized."""
        data: dict[str, Any] = handler(self)
        if data.get("quantization") is None:
            data.pop("quantization", None)
        return data


class StageParams(Record):
    """A stage kind's node params. A field named in `absent_when_default` is left out of the JSON while it holds
    its default, so a param added to a record leaves the keys of the nodes that do not set it as they were."""

    absent_when_default: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _defaults_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.absent_when_default:
            field = type(self).model_fields[name]
            if getattr(self, name) == field.default:
                data.pop(field.alias or name, None)
                data.pop(name, None)
        return data

    def as_params(self) -> dict[str, Any]:
        """The node's params: the JSON its cache key hashes and its stage validates back."""
        return self.model_dump(mode="json", by_alias=True)


class IngestParams(StageParams):
    """`copy`: the recipe's `source_copy`, asked for; a linked source (the default) has no params at all."""

    copy_source: bool = Field(default=False, alias="copy")  # `copy` would shadow BaseModel.copy
    absent_when_default = ("copy_source",)


class PrepareParams(StageParams):
    target: str
    target_code_version: str


class ReferenceParams(StageParams):
    window: int
    max_tokens: int
    greedy_prompts: int
    greedy_tokens: int
    tail_mass: float = TAIL_MASS  # the stored rows' cut (eval.reference_rows)
    max_entries: int = MAX_ENTRIES
    device: DeviceKind = "cpu"  # the kind of device it was computed on (`pipeline.placement`)


class CalibrationParams(StageParams):
    """What llm-compressor calibrates with: the calibration text's samples (the schemes that calibrate on text:
    GPTQ, AWQ, NVFP4's activation scales) and the dtype it computes in (every scheme it quantizes)."""

    samples: int | None = None
    seq_len: int | None = None
    skip_tokens: int | None = None
    compute_dtype: Literal["bfloat16", "float32"] | None = None
    absent_when_default = ("samples", "seq_len", "skip_tokens", "compute_dtype")

    @model_validator(mode="after")
    def _samples_whole(self) -> CalibrationParams:
        given = [f for f in ("samples", "seq_len", "skip_tokens") if getattr(self, f) is not None]
        if given and len(given) != 3:
            raise ValueError(f"calibration samples need samples, seq_len and skip_tokens together; given: {given}")
        return self

    @property
    def tokens(self) -> int:
        """The tokens calibration runs through the model (0: it calibrates on no text)."""
        return (self.samples or 0) * (self.seq_len or 0)


class QuantizeParams(StageParams):
    scheme: Scheme
    calibration: CalibrationParams | None = None  # None: round-to-nearest
    device: DeviceKind | None = None  # placed on the build's device when llm-compressor computes it
    absent_when_default = ("calibration", "device")

    @model_validator(mode="after")
    def _calibrated_as_planned(self) -> QuantizeParams:
        cal = self.calibration
        if self.scheme.by_llmcompressor and (cal is None or cal.compute_dtype is None):
            raise ValueError(
                f"scheme {self.scheme.name!r} is computed by llm-compressor: calibration.compute_dtype needed"
            )
        if self.scheme.calibrated and (cal is None or cal.samples is None):
            raise ValueError(f"scheme {self.scheme.name!r} calibrates on text: calibration samples needed")
        return self


class ExportParams(StageParams):
    artifact: str
    model: str
    target: str
    target_code_version: str
    quant: str
    params: dict[str, Any]  # the recipe's params for its target, checked by the target
    hardware: list[str] | None  # the recipe's narrowing of the profiles it serves; None: all it can


class EvalParams(StageParams):
    artifact: str
    quant: str
    runtime: str
    capabilities: VllmCapabilities | None = None  # vLLM on the CPU: what it can run there, decided at plan time
    environment: str | None = None  # vLLM on a GPU: its environment's lock digest
    gate: Gate
    device: DeviceKind | None = None  # placed on the build's device when the runtime runs on the stage's device
    absent_when_default = ("capabilities", "environment", "device")


class DerivedParams(StageParams):
    """A target's derived node (`targets.base.DerivedNode`): the artifact it evaluates or makes, on a GPU runner of
    one SKU with the runtime pinned under its name (`tensorrt_llm`, the one runtime targets derive stages for).
    An eval names its `runtime` and gets its `gate`; an engine its `limits` and the `commands` that build it."""

    artifact: str
    quant: str
    runtime: str | None = None
    sku: str
    limits: dict[str, int] | None = None
    tensorrt_llm: str
    commands: list[list[str]] | None = None
    gate: Gate | None = None
    absent_when_default = ("runtime", "limits", "commands", "gate")

    def pinned(self, runtime: str) -> str:
        """The version of `runtime` (the stage's `DerivedStage.runtime`) the runner has."""
        if runtime != "tensorrt_llm":
            raise ValueError(f"derived stages pin tensorrt_llm, not {runtime!r}")
        return self.tensorrt_llm


class PublishParams(StageParams):
    model: str
    version: str
    artifact: str
    description: str
    planned: list[str]  # the artifacts the release plans (those this build can make)
    recipe_digest: str


class SealParams(StageParams):
    model: str
    version: str
    artifacts: list[str]


class ReferenceRecord(Record):
    """The reference runtime's logits on the held-out windows (the files), and what they were computed on."""

    runtime: str
    version: str
    source_digest: str
    text_digest: str
    params: ReferenceParams
    windows: int
    tokens: int
    dtype: str = "float32"  # what the reference computed in
    dequantized: str | None = Field(
        default=None, description="the layout a pre-quantized source's weights were dequantized from (fp8-block)"
    )

    @model_serializer(mode="wrap")
    def _plain_sources_unchanged(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `dequantized` key for a plain source's reference: its digest and every eval's key stay as they were."""
        data: dict[str, Any] = handler(self)
        if data.get("dequantized") is None:
            data.pop("dequantized", None)
        return data


class QuantizeRecord(Record):
    """One scheme's quantized Linear weights (the files: `quant.store`'s layout)."""

    scheme: dict[str, Any] = Field(description="the quant.schemes.Scheme, as JSON")
    format: str
    replaced: int
    changed_bf16: list[str] = Field(description="tensors calibration changed (e.g. AWQ-smoothed norms), stored in bf16")
    stored_bytes: int
    source_bytes: int
    calibration: dict[str, Any] | None = None
    passed_through: str | None = Field(
        default=None, description="the layout of a pre-quantized source whose stored tensors are kept as they are"
    )
    dequantized: str | None = Field(
        default=None, description="the layout of a pre-quantized source whose tensors were dequantized first"
    )

    @model_serializer(mode="wrap")
    def _plain_sources_unchanged(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No provenance keys for a plain source's output: its record and digest stay as they were."""
        return _without_none(handler(self), ("passed_through", "dequantized"))

    @property
    def scheme_name(self) -> str:
        return str(self.scheme["name"])


class ArtifactRecord(ArtifactIdentity, Record):
    """An artifact's files (the stage's output): what it is, and everything else its manifest declares about them.

    Made by the export stage, and by a target's derived stages (a TensorRT engine per GPU SKU).
    """

    unsupported: dict[str, str]
    runtime_name: str = Field(description="the runtime that evaluates it first, e.g. llama.cpp, transformers")
    eval_runtimes: list[str] = Field(
        default_factory=list, description="every runtime that evaluates it, `runtime_name` first ([]: that one only)"
    )

    @property
    def runtimes(self) -> list[str]:
        return self.eval_runtimes or [self.runtime_name]

    details: dict[str, Any] = Field(default_factory=dict)
    passed_through: str | None = Field(
        default=None, description="the layout of a pre-quantized source whose stored bytes the artifact keeps"
    )
    dequantized: str | None = Field(
        default=None,
        description="the layout of a pre-quantized source whose tensors the artifact holds dequantized (in bf16, or "
        "quantized again into its scheme)",
    )

    @model_serializer(mode="wrap")
    def _plain_sources_unchanged(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No provenance keys for an artifact of a plain source: its record and digest stay as they were."""
        return _without_none(handler(self), ("passed_through", "dequantized"))


def _without_none(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class PreparedRecord(Record):
    """What a target computed once per source for all its exports (`TargetSpec.prepare`)."""

    target: str
    data: dict[str, Any]


class PublishRecord(Record):
    artifact: str
    manifest_digest: str


class SealRecord(Record):
    model: str
    version: str
    status: str
