"""Runtimes that load an artifact and give logits for token ids, behind one small protocol.

`open_runtime(name, path)` opens the runtime a target declares (`TargetSpec.runtime`). A runtime
that has no implementation here, or whose package this machine lacks, raises `Deferred` with
`details["runtime_needed"]`; the eval records that as *not evaluated here*, never as passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.errors import Deferred
from eval.runtimes.base import CachedRuntime, Runtime, check_ids
from eval.runtimes.jax_runtime import JaxRuntime
from eval.runtimes.layer_stream import open_transformers
from eval.runtimes.llama_cpp_runtime import LlamaCppRuntime
from eval.runtimes.tensorrt_llm_runtime import TensorRTLLMRuntime
from eval.runtimes.transformers_runtime import TransformersRuntime
from eval.runtimes.vllm_runtime import VllmRuntime

__all__ = [
    "RUNTIMES",
    "CachedRuntime",
    "JaxRuntime",
    "LlamaCppRuntime",
    "Runtime",
    "TensorRTLLMRuntime",
    "TransformersRuntime",
    "VllmRuntime",
    "check_ids",
    "open_runtime",
]

# Runtime name (as targets declare it) -> the class that opens an artifact path with it.
RUNTIMES: dict[str, Any] = {
    # One layer at a time where the architecture streams (eval.runtimes.layer_stream), else the whole model.
    TransformersRuntime.name: open_transformers,
    LlamaCppRuntime.name: LlamaCppRuntime,
    JaxRuntime.name: JaxRuntime,
    # In its own environment (`kiln runtime install vllm`); without it, Deferred (not evaluated here).
    VllmRuntime.name: VllmRuntime,
    # Opens only on a GPU runner with tensorrt_llm; elsewhere it raises Deferred (not evaluated here).
    TensorRTLLMRuntime.name: TensorRTLLMRuntime,
}


def open_runtime(name: str, artifact: str | Path, **options: Any) -> Runtime:
    """Open `artifact` (a directory or file) in runtime `name`, or raise `Deferred` if it is not here."""
    cls = RUNTIMES.get(name)
    if cls is None:
        raise Deferred(
            f"runtime {name!r} is not available on this machine (available: {', '.join(RUNTIMES)})",
            details={"runtime_needed": name},
        )
    runtime: Runtime = cls(artifact, **options)
    return runtime
