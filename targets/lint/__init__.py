"""The artifact lint: check an artifact directory against what its runtime loads, without running a model.

One checker per format, each a target's `TargetSpec.lint` (declared by the target when it registers):

    lint_safetensors   hf (`targets.lint.hf`): hf-bundle, rocm-bundle, trtllm (compressed-tensors, ModelOpt, dense)
    lint_gguf          gguf (`targets.lint.gguf`): the GGUF file llama.cpp loads
    lint_orbax         orbax (`targets.lint.orbax`): config.json, weights.json, sharding.json, the checkpoint

Each is a function of a `LintRequest` returning a `LintReport` of `Finding`s with stable codes (`CODES`),
reading headers first and then one scale tensor at a time, so memory is bounded by the largest scale
tensor (a GGUF tensor's block scales are read in chunks). The export stage lints what it wrote, publish
refuses an artifact with an error, and `kiln lint` runs the same checks on any directory.

The checkers import numpy (and tensorstore for orbax) when called; this module imports neither, so recipe
checks and `kiln plan` keep importing `targets` without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.targets.lint.findings import (
    CODES,
    ArtifactLintFailed,
    Finding,
    LintReport,
    LintRequest,
)

if TYPE_CHECKING:
    from kiln.formats.architectures.shape import ModelShape

__all__ = [
    "CODES",
    "ArtifactLintFailed",
    "Finding",
    "LintReport",
    "LintRequest",
    "detect_format",
    "lint_artifact",
    "lint_gguf",
    "lint_orbax",
    "lint_safetensors",
]


def lint_safetensors(req: LintRequest) -> LintReport:
    """Lint an HF-format checkpoint directory (see `targets.lint.hf`)."""
    from kiln.targets.lint.hf import lint_bundle

    return lint_bundle(req)


def lint_gguf(req: LintRequest) -> LintReport:
    """Lint the GGUF file(s) of a directory (see `targets.lint.gguf`)."""
    from kiln.targets.lint.gguf import lint_gguf_dir

    return lint_gguf_dir(req)


def lint_orbax(req: LintRequest) -> LintReport:
    """Lint an orbax artifact directory (see `targets.lint.orbax`)."""
    from kiln.targets.lint.orbax import lint_orbax_dir

    return lint_orbax_dir(req)


def detect_format(root: Path) -> str:
    """The format of an artifact directory (or a lone .gguf file), from the files it holds (a target's
    `TargetSpec.format`)."""
    if root.is_file() and root.suffix == ".gguf":
        return "gguf-v3"
    if not root.is_dir():
        raise InvalidInput(f"{root} is not a directory", code=Codes.LINT_NOT_AN_ARTIFACT, details={"path": str(root)})
    names = {p.name for p in root.iterdir()}
    if "weights.json" in names and (root / "checkpoint").is_dir():
        return "orbax-checkpoint"
    if any(n.endswith(".gguf") for n in names) and "config.json" not in names:
        return "gguf-v3"
    if "config.json" in names and any(n.endswith(".safetensors") or n.endswith(".index.json") for n in names):
        return "safetensors"
    raise InvalidInput(
        f"{root}: not an artifact kiln lints (a .gguf file; config.json with SafeTensors shards; or an orbax "
        "checkpoint with weights.json)",
        code=Codes.LINT_NOT_AN_ARTIFACT,
        details={"path": str(root)},
    )


def lint_artifact(
    root: Path, *, shape: ModelShape | None = None, quant: str | None = None, target: str | None = None
) -> LintReport:
    """Lint `root` with the checker its target declares: the named `target`'s, else the one the targets of
    its format (`detect_format`) declare."""
    from kiln.targets.base import all_targets, get_target

    if target is not None:
        spec = get_target(target)
        if spec.lint is None:
            raise InvalidInput(f"target {target!r} declares no lint", code=Codes.LINT_UNSUPPORTED)
        return spec.lint(LintRequest(root, shape, quant))
    fmt = detect_format(root)
    checkers = {s.lint for s in all_targets().values() if s.format == fmt and s.lint is not None}
    if len(checkers) != 1:
        raise InvalidInput(
            f"{root}: the {fmt} targets declare {len(checkers)} lints; name one with --target",
            code=Codes.LINT_UNSUPPORTED,
        )
    return checkers.pop()(LintRequest(root, shape, quant))
