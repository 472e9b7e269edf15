"""What each stage hands the next: frozen, validated records, one type per stage, stored in `stage.json`.

A stage returns its record; the executor writes `record.model_dump(mode="json")` as the output's
`result` (with the record's name) and reads it back through the same type, so a consumer gets typed
fields (`ingest.result.source_digest`), never a string-keyed dict, and a `stage.json` that does not
match its schema is an error, not a KeyError three stages later.

The eval stage's record is `core.evals.EvalReport`; the publish stage sends it to the registry as a
`core.evals.PublishedEval`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from kiln.core.manifest import ArtifactIdentity, FileEntry
from kiln.core.shape import ShapeRecord
from kiln.eval.reference_rows import MAX_ENTRIES, TAIL_MASS
from kiln.formats.prequantized import QuantizationRecord


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


class ReferenceParams(Record):
    window: int
    max_tokens: int
    greedy_prompts: int
    greedy_tokens: int
    tail_mass: float = TAIL_MASS  # the stored rows' cut (eval.reference_rows)
    max_entries: int = MAX_ENTRIES
    device: Literal["cpu", "cuda"] = "cpu"  # the kind of device it was computed on (`pipeline.placement`)


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
