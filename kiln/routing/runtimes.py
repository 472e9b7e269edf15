"""The runtimes that serve kiln's artifacts, as data: which one serves an artifact (by its target and format),
the flags that size it as resolve did, and the KServe ServingRuntime that runs it; and the device plugin
resource each hardware family is requested by.

Sources: vLLM's `vllm serve` flags (`--tensor-parallel-size`, `--max-model-len`, `--max-num-seqs`,
`--served-model-name`; the last one given wins, so a flag here overrides the runtime's own); llama.cpp's
`llama-server` (`--ctx-size` is the context of all `--parallel` slots together, `--alias` the served
name); TensorRT-LLM's `trtllm-serve` (`--tp_size`, `--max_seq_len`, `--max_batch_size`); KServe v0.20.0
`config/runtimes/kserve-vllmserver.yaml` (the built-in ClusterServingRuntime for vLLM, model format `vLLM`,
which passes `--served-model-name={{.Name}}`; an InferenceService's args follow the runtime's:
`MergeRuntimeContainers`); kiln's engines are built at TP 1 (`targets/trtllm/engines.py`, `--tp_size 1`).
The Kubernetes resources are the vendors' device plugins: NVIDIA's `nvidia.com/gpu`, AMD's `amd.com/gpu`,
Google's `google.com/tpu` on GKE.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, UnknownName


@dataclass(frozen=True)
class ServingRuntime:
    """A runtime that serves an artifact, and how KServe runs it."""

    name: str
    serves: str  # what it serves, for people
    # Flags sized from the placement: {served_name}, {tp}, {context}, {concurrency}, {total_context}.
    args: tuple[str, ...]
    kserve_runtime: str | None  # the ServingRuntime (or ClusterServingRuntime) name; None: KServe has none
    kserve_model_format: str | None
    kserve_builtin: bool  # shipped with KServe; else the operator installs a ServingRuntime of that name
    fixed_tp: int | None = None  # the artifact runs at this TP only

    def sized_args(self, served_name: str, tp: int, context: int, concurrency: int) -> list[str]:
        values = {
            "served_name": served_name,
            "tp": tp,
            "context": context,
            "concurrency": concurrency,
            "total_context": context * concurrency,
        }
        return [arg.format(**values) for arg in self.args]


_VLLM_ARGS = (
    "--served-model-name={served_name}",
    "--tensor-parallel-size={tp}",
    "--max-model-len={context}",
    "--max-num-seqs={concurrency}",
)

_RUNTIMES = (
    ServingRuntime("vllm", "hf-bundle (CUDA, CPU)", _VLLM_ARGS, "kserve-vllmserver", "vLLM", True),
    ServingRuntime("vllm-rocm", "rocm-bundle (vLLM's ROCm build)", _VLLM_ARGS, "kiln-vllm-rocm", "vLLM", False),
    ServingRuntime(
        "llama.cpp",
        "gguf (llama-server)",
        ("--alias={served_name}", "--ctx-size={total_context}", "--parallel={concurrency}"),
        "kiln-llama-cpp",
        "gguf",
        False,
    ),
    ServingRuntime(
        "tensorrt-llm",
        "trtllm checkpoints (trtllm-serve, PyTorch backend)",
        ("--tp_size={tp}", "--max_seq_len={context}", "--max_batch_size={concurrency}"),
        "kiln-tensorrt-llm",
        "tensorrt-llm",
        False,
    ),
    ServingRuntime(
        "tensorrt-llm-engine",
        "trtllm engines (TensorRT backend, built per SKU)",
        (),
        "kiln-tensorrt-llm-engine",
        "tensorrt-llm-engine",
        False,
        fixed_tp=1,
    ),
    ServingRuntime("jax", "orbax checkpoints (kiln's JAX forward)", (), None, None, False),
)
RUNTIMES: dict[str, ServingRuntime] = {r.name: r for r in _RUNTIMES}

# (target, format) of an artifact -> the runtime that serves it.
SERVED_BY: dict[tuple[str, str], str] = {
    ("hf-bundle", "safetensors"): "vllm",
    ("rocm-bundle", "safetensors"): "vllm-rocm",
    ("gguf", "gguf-v3"): "llama.cpp",
    ("trtllm", "safetensors"): "tensorrt-llm",
    ("trtllm", "trtllm-engine"): "tensorrt-llm-engine",
    ("orbax", "orbax-checkpoint"): "jax",
}

# A hardware family -> the resource its devices are requested by (None: CPUs, counted by the scheduler).
DEVICE_RESOURCES: dict[str, str | None] = {
    "cuda": "nvidia.com/gpu",
    "rocm": "amd.com/gpu",
    "tpu": "google.com/tpu",
    "cpu": None,
}


def runtime_for(target: str, format: str) -> ServingRuntime:
    """The runtime that serves an artifact of `target` in `format`; ROUTING_RUNTIME_UNKNOWN lists the known pairs."""
    name = SERVED_BY.get((target, format))
    if name is None:
        known = ", ".join(f"{t}/{f}" for t, f in SERVED_BY)
        raise UnknownName(
            f"no serving runtime is known for {target}/{format} artifacts; known: {known}",
            code=Codes.ROUTING_RUNTIME_UNKNOWN,
            details={"target": target, "format": format, "known": [f"{t}/{f}" for t, f in SERVED_BY]},
        )
    return RUNTIMES[name]


def device_resource(hardware: str, family: str) -> str | None:
    """The device plugin resource a pool's replica requests its devices by; refused for a family without one."""
    if family not in DEVICE_RESOURCES:
        raise InvalidInput(
            f"hardware {hardware!r} ({family}) has no Kubernetes device plugin to request it by; "
            f"families: {', '.join(DEVICE_RESOURCES)}",
            code=Codes.ROUTING_HARDWARE_UNSUPPORTED,
            details={"hardware": hardware, "family": family},
        )
    return DEVICE_RESOURCES[family]
