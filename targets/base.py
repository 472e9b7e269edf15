"""The target registry: each output format registers itself once, declaring what it supports as data.

Target modules are imported from a fixed list in this file, never from a user-supplied string.
Registering a name twice fails loudly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError, UnknownName

if TYPE_CHECKING:
    from pipeline.ingest import SourceModel

# The modules that define kiln's targets; each calls `register` once at import.
BUILTIN_TARGET_MODULES = ("targets.gguf", "targets.hf_bundle")


@dataclass(frozen=True)
class ExportRequest:
    quant: str
    out_dir: Path  # an empty temporary directory; the stage renames it into place when export returns
    params: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""  # the recipe's model name, for formats that record one (GGUF general.name)
    on_progress: Callable[[int], None] = lambda nbytes: None  # source bytes consumed so far (increment)
    # The shared quantize stage's output for this quant (`pipeline.quantize.store.QuantizedWeights`),
    # given exactly when the target lists the quant in `TargetSpec.quantized_input`.
    quantized: Any = None


@dataclass(frozen=True)
class ExportResult:
    files: list[str]  # paths relative to out_dir, every file the artifact consists of
    runtime: dict[str, Any]  # runtime requirements recorded in the manifest
    details: dict[str, Any] = field(default_factory=dict)  # extra provenance (e.g. fallbacks taken)
    # Hardware this artifact runs on, with the reason for each; None: the target's `hardware` as declared.
    hardware: dict[str, str] | None = None


ExportFn = Callable[["SourceModel", ExportRequest], ExportResult]


@dataclass(frozen=True)
class TargetSpec:
    name: str
    format: str
    quants: tuple[str, ...]
    hardware: tuple[str, ...]
    runtime: str  # the runtime eval loads it with, e.g. "llama.cpp" or "transformers"
    code_version: str  # bump when the output for the same input changes; part of the cache key
    export: ExportFn
    description: str = ""
    # Quants whose export consumes the shared `quantize/<quant>` stage (computed once, used by every target).
    quantized_input: tuple[str, ...] = ()

    def check_quant(self, quant: str) -> None:
        if quant not in self.quants:
            raise UnknownName(
                f"target {self.name!r} does not support quant {quant!r}; supported: {', '.join(self.quants)}",
                details={"target": self.name, "known": list(self.quants)},
            )


_REGISTRY: dict[str, TargetSpec] = {}


def register(spec: TargetSpec) -> TargetSpec:
    if spec.name in _REGISTRY:
        raise KilnError(f"target {spec.name!r} is registered twice", code="TARGET_REGISTERED_TWICE")
    _REGISTRY[spec.name] = spec
    return spec


def _load_builtin() -> None:
    for module in BUILTIN_TARGET_MODULES:
        spec = getattr(importlib.import_module(module), "SPEC", None)
        if not isinstance(spec, TargetSpec) or _REGISTRY.get(spec.name) is not spec:
            raise KilnError(f"target module {module} did not register its SPEC", code="TARGET_NOT_REGISTERED")


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
