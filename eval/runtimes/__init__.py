"""Runtimes that load an artifact and give logits for token ids, behind one small protocol.

`open_runtime(name, path)` opens the runtime a target declares (`TargetSpec.runtime`), with the opener of
its row of `eval.runtimes.facts.RUNTIME_FACTS`, the one table of what kiln knows of each runtime. A runtime
that has no implementation here, or whose package this machine lacks, raises `Deferred` with
`details["runtime_needed"]`; the eval records that as *not evaluated here*, never as passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.errors import Deferred
from kiln.eval.runtimes.base import CachedRuntime, Runtime, check_ids
from kiln.eval.runtimes.facts import RUNTIME_FACTS
from kiln.eval.runtimes.jax_runtime import JaxRuntime
from kiln.eval.runtimes.llama_cpp_runtime import LlamaCppRuntime
from kiln.eval.runtimes.tensorrt_llm_runtime import TensorRTLLMRuntime
from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
from kiln.eval.runtimes.vllm_runtime import VllmRuntime

__all__ = [
    "RUNTIME_FACTS",
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


def open_runtime(name: str, artifact: str | Path, **options: Any) -> Runtime:
    """Open `artifact` (a directory or file) in runtime `name`, or raise `Deferred` if it is not here."""
    facts = RUNTIME_FACTS.get(name)
    if facts is None:
        raise Deferred(
            f"runtime {name!r} is not available on this machine (available: {', '.join(RUNTIME_FACTS)})",
            details={"runtime_needed": name},
        )
    runtime: Runtime = facts.opener(artifact, **options)
    return runtime
