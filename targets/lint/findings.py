"""What a lint says: findings with stable codes, the report of one artifact, and the error that refuses it.

Every code is listed once in `CODES` with its severity and what it means (docs/targets.md prints the same
table). An error-level finding is a fault the artifact's runtime fails on, or computes wrongly from, at load;
a warning is something the lint could not check, or that a runtime tolerates.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from kiln.core.errors import StageFailed

if TYPE_CHECKING:
    from kiln.formats.architectures.shape import ModelShape

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Code:
    severity: Severity
    meaning: str


CODES: Final[dict[str, Code]] = {
    # Files and headers.
    "FILE_MISSING": Code("error", "a file the runtime reads is absent (config.json, a shard, weights.json, ...)"),
    "JSON_INVALID": Code("error", "a JSON file of the artifact cannot be parsed or has the wrong shape"),
    "SAFETENSORS_HEADER": Code("error", "a SafeTensors shard's header is invalid (JSON, dtypes, offsets)"),
    "SAFETENSORS_INDEX": Code("error", "model.safetensors.index.json disagrees with the shards"),
    "GGUF_HEADER": Code("error", "the GGUF header is invalid (what llama.cpp's gguf_init refuses)"),
    "GGUF_KEY_MISSING": Code("error", "a GGUF metadata key llama.cpp requires is absent or of the wrong type"),
    "GGUF_TYPE_UNCHECKED": Code("warning", "a GGUF tensor type kiln cannot decode: its block scales are not read"),
    # Model metadata.
    "CONFIG_INVALID": Code("error", "config.json fails its family's schema"),
    "CONFIG_LAYER_TYPES": Code(
        "error", "per-layer attention kinds (layer_types, a sliding pattern) disagree with the layers"
    ),
    "CONFIG_SLIDING_WINDOW": Code("error", "sliding layers without a window, or a window the config does not have"),
    "CONFIG_ROPE": Code("error", "rope metadata disagree (base, dimensions, one per layer type)"),
    "CONFIG_EXPERTS": Code("error", "the expert count or experts per token disagree with the tensors or the config"),
    "CONFIG_MISMATCH": Code("error", "a hyper-parameter disagrees between two places that state it"),
    "QUANT_CONFIG_INVALID": Code("error", "quantization_config / hf_quant_config.json is unreadable or not a loader's"),
    # Tensors.
    "TENSOR_MISSING": Code("error", "a tensor the format's config implies is absent"),
    "TENSOR_UNEXPECTED": Code("error", "a tensor no loader of the format reads (vLLM refuses unknown weights)"),
    "TENSOR_SHAPE": Code("error", "a tensor's shape is not what the config implies"),
    "TENSOR_DTYPE": Code("error", "a tensor's dtype is not what the format stores there"),
    "QUANT_TARGET_MISMATCH": Code(
        "error", "a module stored quantized that the config leaves unquantized, or the reverse"
    ),
    "LM_HEAD_QUANT": Code("error", "lm_head quantized where the config or the runtime says it is not, or the reverse"),
    # Scales.
    "SCALE_MISSING": Code("error", "a quantized Linear (or the KV cache) lacks a scale its runtime loads"),
    "SCALE_ZERO": Code("error", "a scale is zero: the Linear's output is zero, or divided by zero"),
    "SCALE_NAN": Code("error", "a scale is NaN: the runtime's output turns NaN"),
    "SCALE_INF": Code("error", "a scale is infinite"),
    "SCALE_NEGATIVE": Code("error", "a symmetric scale is negative"),
    "SCALE_SHAPE": Code("error", "a scale's shape does not fit its scheme's strategy (channel, group, block)"),
    "SCALE_LAYOUT": Code("error", "per-expert and stacked (fused) expert layouts mixed in one layer"),
    "SCALES_UNREAD": Code("warning", "scale values could not be read here (a reader is not installed)"),
    "ORBAX_SHARDING": Code("error", "sharding.json does not give one partition spec per tensor of weights.json"),
}


@dataclass(frozen=True)
class Finding:
    """One fault: its code, the tensor or key it concerns (`subject`), what is wrong, and the file."""

    code: str
    subject: str
    message: str
    file: str | None = None
    severity: Severity = "error"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "severity": self.severity, "subject": self.subject}
        out["message"] = self.message
        if self.file is not None:
            out["file"] = self.file
        return out


def finding(code: str, subject: str, message: str, file: str | None = None, *, warn: bool = False) -> Finding:
    """A finding of `code` at the code's own severity (`warn`: a warning whatever the code's)."""
    severity: Severity = "warning" if warn else CODES[code].severity
    return Finding(code, subject, message, file, severity)


@dataclass(frozen=True)
class LintRequest:
    """What a lint checks: the artifact directory, and optionally the model it was made from (`shape`, the
    source's checked config) and the quant it should hold. Without them the artifact is checked against its
    own metadata only."""

    root: Path
    shape: ModelShape | None = None
    quant: str | None = None


@dataclass
class LintReport:
    """Everything a lint found in one artifact, and how much it read."""

    artifact: str
    format: str
    findings: list[Finding] = field(default_factory=list)
    tensors: int = 0  # tensors whose name, shape and dtype were checked
    scales: int = 0  # scale tensors (or GGUF block-scale fields) whose values were read
    scale_bytes: int = 0

    def add(self, f: Finding) -> None:
        self.findings.append(f)

    def extend(self, fs: list[Finding]) -> None:
        self.findings.extend(fs)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> dict[str, Any]:
        """A small record of the lint for an artifact's provenance: counts, and the warnings' codes."""
        return {
            "errors": len(self.errors),
            "warnings": dict(sorted(Counter(f.code for f in self.warnings).items())),
            "tensors": self.tensors,
            "scales": self.scales,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact": self.artifact,
            "format": self.format,
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "tensors": self.tensors,
            "scales": self.scales,
            "scale_bytes": self.scale_bytes,
            "findings": [f.to_json() for f in self.findings],
        }

    def raise_for_errors(self, what: str) -> None:
        """ArtifactLintFailed naming the first error's code and tensor, when there is an error."""
        if self.errors:
            raise ArtifactLintFailed(what, self)


class ArtifactLintFailed(StageFailed):
    """An artifact the lint refuses; the code is its first error's (SCALE_NAN, LM_HEAD_QUANT, ...), the
    message names the tensor or key, and `details["findings"]` lists every error."""

    @classmethod
    def check_code(cls, code: str) -> None:
        """A lint code (`CODES`, listed in docs/targets.md) rather than one of the error catalog."""
        if code not in CODES:
            super().check_code(code)

    def __init__(self, what: str, report: LintReport) -> None:
        first = report.errors[0]
        more = len(report.errors) - 1
        where = f" ({first.file})" if first.file else ""
        super().__init__(
            f"{what}: lint {first.code} {first.subject}{where}: {first.message}"
            + (f" (and {more} more error(s))" if more else ""),
            code=first.code,
            details={
                "artifact": report.artifact,
                "tensor": first.subject,
                "findings": [f.to_json() for f in report.errors[:50]],
                "errors": len(report.errors),
            },
        )
        self.report = report
