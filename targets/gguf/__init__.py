"""The `gguf` target: one GGUF v3 file with tokenizer metadata, for llama.cpp on CPU, Apple and edge.

Layout: `constants` (the format as data), `writer` (streaming GGUF writer, a state machine),
`convert` (HF -> GGUF names, q/k permutation, per-tensor types), `quants` (F16/BF16/Q8_0/Q4_0
encoders), `tokenizer` (vocab, merges, pre-tokenizer), `export` (the stage function).
Only `constants` is imported here: the registry server imports `targets` and has no numpy or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from targets.base import TargetSpec, register

from .constants import QUANTS

if TYPE_CHECKING:
    from pipeline.ingest import SourceModel
    from targets.base import ExportRequest, ExportResult

CODE_VERSION = "gguf-1"


def _export(source: SourceModel, req: ExportRequest) -> ExportResult:
    from .export import export

    return export(source, req)


SPEC = register(
    TargetSpec(
        name="gguf",
        format="gguf-v3",
        quants=tuple(QUANTS),
        hardware=("cpu", "apple-m2", "edge"),
        runtime="llama.cpp",
        code_version=CODE_VERSION,
        export=_export,
        description="GGUF v3 for llama.cpp: F16/BF16/Q8_0/Q4_0 written by kiln, Q4_K_M/Q6_K by llama.cpp's quantizer",
    )
)
