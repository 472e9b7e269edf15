"""The `gguf` target: one GGUF v3 file with tokenizer metadata, for llama.cpp on CPU, Apple and edge.

Layout: the format itself (constants, reader, writer, quant encoders, the llama.cpp architectures) is
`formats.gguf`; here are `convert` (tensor kinds -> GGUF names, stacked experts, q/k permutation, norm offsets,
per-tensor types), `tokenizer` (vocab, merges, pre-tokenizer) and `export` (what llama.cpp would compute
differently is refused, the metadata, the stage function). Each family is written through its record's `gguf`
mapping (`formats.architectures`). Only the constants are imported here: recipe checks
and `kiln plan` import `targets` and load neither numpy nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.core.hardware import PROFILES
from kiln.formats.gguf.constants import QUANTS
from kiln.targets.base import TargetSpec, register
from kiln.targets.lint import lint_gguf

if TYPE_CHECKING:
    from kiln.formats.architectures.shape import ModelShape
    from kiln.formats.hf_model import SourceModel
    from kiln.targets.base import ExportRequest, ExportResult

CODE_VERSION = "gguf-1"
# llama.cpp serves the catalog's CPUs (x86-64 and arm64 boards) and Apple GPUs (Metal).
LLAMA_CPP_FAMILIES = ("cpu", "metal")


def _export(source: SourceModel, req: ExportRequest) -> ExportResult:
    from kiln.targets.gguf.export import export

    return export(source, req)


def _check_model(shape: ModelShape, config: Mapping[str, Any], quant: str, params: dict[str, Any]) -> None:
    from kiln.targets.gguf.export import check_model

    check_model(shape, config, quant, params)


def _check_source(source: SourceModel) -> None:
    """The prepare stage's check of the tokenizer's special tokens (`tokenizer.check_special_tokens`), at plan time;
    a source without tokenizer.json is left to the stage."""
    from kiln.targets.gguf.tokenizer import check_special_tokens

    if "tokenizer.json" in source.tokenizer_files:
        check_special_tokens(source.root, source.shape.vocab_size)


def _prepare(source: SourceModel) -> dict[str, Any]:
    from kiln.targets.gguf.export import prepare

    return prepare(source)


SPEC = register(
    TargetSpec(
        per_architecture=True,
        name="gguf",
        format="gguf-v3",
        quants=tuple(QUANTS),
        hardware=tuple(name for name, hw in PROFILES.items() if hw.family in LLAMA_CPP_FAMILIES),
        runtime="llama.cpp",
        code_version=CODE_VERSION,
        export=_export,
        prepare=_prepare,
        check_model_fn=_check_model,
        check_source_fn=_check_source,
        lint=lint_gguf,
        # kiln's writer encodes a tensor at a time (at 8B: 0.03-0.15 GiB over the stage's start, a fraction of the
        # 1.05 GB embedding); llama.cpp's quantizer converts each tensor to float32 (twice its bf16 bytes) and
        # writes its quantized copy besides (at 8B, Q4_K_M: 2.4-2.6 GiB over the start, 2.5-2.6 copies).
        export_tensor_copies={"*": 1.0, **{q: 3.0 for q, spec in QUANTS.items() if spec.llama_ftype is not None}},
        description="GGUF v3 for llama.cpp: F16/BF16/Q8_0/Q4_0/MXFP4/NVFP4 written by kiln, Q4_K_M/Q6_K by llama.cpp's "
        "quantizer; a release's MXFP4 experts kept as MXFP4",
    )
)
