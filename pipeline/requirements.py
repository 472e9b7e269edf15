"""What each stage needs of the machine that runs it, computed from the model's shape: the device it computes
on (kind, count, memory per device), host memory, cores, an accelerator, a runtime.

Every node of the graph carries its `Requirements`, computed when the graph is planned from the model's
shape (`formats.architectures.shape.ModelShape`, read from config.json: the SafeTensors headers are not needed, so a
shape-only source plans too), the stage's scheme and params, and the device the plan is for (`PlanDevice`:
the CPU, or a GPU whose memory comes from torch on a machine that has one, or from a hardware SKU of the
catalog, `core.hardware`, when planning a fleet from elsewhere). Nothing here is fixed per stage kind but
the cores, the bytes a stage's imports take (`base_mib`) and the factors of the formulas below.

Notation: h hidden size, f intermediate size, q = heads × head_dim, V vocabulary, L layers, P_L the
parameters of one decoder layer (every tensor of `model.layers.0.`), s the bytes of one source weight
(2 for bf16), T the eval's scored tokens (`eval.max_tokens`), W its window, G its greedy tokens. The
activations of n tokens through one layer, float32, are A(n) = 4·n·(4h + 3f): the residual stream in and
out, the normed input and the attention output (4 × h), the MLP's gate, up and their product (3 × f);
attention runs through SDPA, whose scores are never materialised whole. An eval compares window by window
on the host: its window and the reference's in float32 and a float64 block of at most a window's rows,
C = 16·W·V.

- Streaming stages (ingest, round-to-nearest quantize, every export): one tensor at a time, so
  `factor` × the largest tensor (s × its elements), on the CPU: ingest 2, round-to-nearest 2, an export its
  target's `export_tensor_copies` (kiln's GGUF writer 1, HF-format bundles 2, llama.cpp's quantizer and orbax 3),
  each above what was measured at Llama-3-8B's shape (bench/results/scale.jsonl).
- The reference and a transformers eval hold the model as `eval.runtimes.residency.hold` decides from the
  plan's memory budget on the stage's device (`PlanDevice.memory_budget`: `HOLD_UTILIZATION` of the GPU's
  memory, or of the host's on the CPU, the stage's base and host bytes included there); the node's
  `Requirements.weights` says which, and the stage holds it so. Whole, in float32: 4·N (N the model's
  parameters) + A(W) + 4·W·V (on a GPU the model is read on the host first: 4·N there too). Streamed, one
  decoder layer at a time in float32 (`eval.runtimes.layer_stream`): 4·P_L (the layer) + 4·min(V, HEAD_BLOCK)·h
  (a row block of the embedding / lm_head) + 8·T'·h (the hidden states of every sequence, in and out of the
  layer: T' = T for the reference, T + prompts·(32 + G) for an eval's windows and teacher-forced sequences)
  + A(W) + 4·W·V (one window's logits); on the host besides: s·P_L (the layer as read from the SafeTensors)
  and 4·W·V; plus what the budget leaves resident (the float32 head, then, for the reference, which decodes
  its own greedy continuation, every layer: 4·(N - V·h) untied, 4·N tied). An eval also holds C on the host.
  An architecture that does not stream loads whole.
- Calibrated quantization (GPTQ / AWQ, llm-compressor's sequential pipeline, `quant.calibrated`): on the
  device c·P_L (one layer in the compute dtype: c = 2 for bfloat16, 4 for float32) + A(seq_len) (one
  sample through the layer) + the method's working set. GPTQ: the Hessians of every Linear of the layer,
  4·in_features² each, held together through the forward, and while the widest is factorised one more
  copy of it (LAPACK's column-major copy) and that Linear's weight in float32, 4·in_max² + 4·P_lin. AWQ:
  the balanced Linears of its largest mapping (P_bal, Llama's gate and up: 2·f·h), their original weights
  kept in the compute dtype, c·P_bal, and three float32 temporaries of them per grid point (scaled,
  quantized, unscaled), 12·P_bal. On the host, where the pipeline keeps them, the boundary activations
  of every sample, 8·samples·seq_len·h (in and out of the layer, float32), and for AWQ its cached inputs
  of the smoothed Linears, 4·samples·seq_len·(2h + q + f). Measured at Llama-3-8B's layer width
  (bench/calibration_memory.py, bf16, 4 samples of 64 tokens): GPTQ 2.56-2.61 GB of anonymous memory
  over the import baseline (formula 2.72 GB), AWQ 2.18-2.22 GB (formula 2.09 GB + the pipeline's own).
- Serving runtimes on a GPU (vLLM, TensorRT-LLM): the artifact's weights (`quant.footprint`) ÷ TP + the
  KV cache of one sequence of W + G tokens as vLLM pages it on that GPU (`placement.model.PagedKvCache`: bf16,
  16-token pages of every full layer, a sliding layer's window and the tokens in flight; 2·L·kv_heads·head_dim·
  (W + G)·2 bytes for a dense model at whole pages), split over TP (replicated when TP > kv_heads); TP, the
  device count, is the smallest power of two (dividing the heads, up to the GPUs of one node) whose per-device
  share fits `MEMORY_UTILIZATION` of the device's memory (vLLM's default); on the host, the largest tensor as
  the checkpoint loads, and C. vLLM on the CPU holds the weights and the KV cache the eval reserves
  (`eval.runtimes.vllm_runtime.kv_cache_reservation`: a sequence of W + G + 1 tokens in float32 at 128-token
  pages and the page vLLM keeps back, at least 256 MiB) in host memory, and that whole sum × `VLLM_CPU_MEASURED`
  (1.6: what its worker was measured to hold beyond it).
- llama.cpp (CPU): the GGUF file's bytes (mapped) + the repacked copy its CPU backend makes of the Q4_0 / Q4_K /
  MXFP4 tensors (`placement.weights.CPU_REPACKED`) + its KV cache + C.
- The JAX forward (`eval.runtimes.jax_runtime`) restores the orbax checkpoint one decoder layer at a time
  onto its device: s·(P_L + V·h) (a layer and the embedding or the head, as stored) + 4·P_L (the layer's
  weights cast to float32 as used) + 4·min(V, HEAD_BLOCK)·h (a block of the head in float32) + 16·T·h (the
  hidden states of every window, padded to its power-of-two bucket, in and out of the layer) + the KV cache
  in float32 + A(W) + 4·W·V, and C on the host; a checkpoint of at most 256 MiB (`RESIDENT_BYTES`) is
  restored whole, its bytes in place of the first term. A mixture of experts' layer is restored with all
  E of its experts (P_L counts them) and runs them all on every token: 4·W·E·(3·f_e + h) more (f_e the
  experts' intermediate size).

A stage on a GPU needs that many GPUs (`gpus`, Ray's `num_gpus`) with `device_memory_bytes` each, and
`memory_bytes` of host memory (its base, plus what it keeps on the host); a stage on the CPU needs no GPU
and `memory_bytes` = base + everything. `fits` says whether the per-device share fits the GPU sized for
(its whole memory for one GPU's stage, `MEMORY_UTILIZATION` of it under a serving runtime).
The figures are planning estimates for a scheduler, not limits enforced on the stage.

Executors translate them: Ray asks for `num_cpus`, `memory`, `num_gpus` and the custom resource
`accelerator:<sku>` (`ray_resources`); the release workflow picks a runner by its labels (`RUNNER_LABELS`,
overridable by the recipe's `runners:`). `cpus` is also the number of threads the stage computes with, on
any machine (`pipeline.executors.node`): a reduction over other thread counts gives other last bits, and
an output must not depend on where it was made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, computed_field, model_validator

from kiln.core.device import (
    CPU,
    Device,
    DeviceKind,
    DeviceUnavailable,
    InvalidDevice,
    cuda_device_count,
    host_memory_bytes,
)
from kiln.core.errors import KilnError, SourceInvalid, UnknownName
from kiln.core.hardware import PROFILES, get_profile
from kiln.core.shape import ShapeRecord
from kiln.eval.runtimes.base import HEAD_BLOCK
from kiln.eval.runtimes.facts import RUNTIME_FACTS, RuntimeFacts
from kiln.eval.runtimes.layer_stream import STREAMED_MODEL_TYPES
from kiln.eval.runtimes.residency import Residency, hold
from kiln.eval.runtimes.vllm_runtime import kv_cache_reservation
from kiln.eval.text import DEFAULT_PROMPT_TOKENS
from kiln.formats.architectures.record import TensorKind, TensorSpec
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.gguf.constants import QUANTS as GGUF_QUANTS
from kiln.formats.hf_model import SourceModel
from kiln.formats.safetensors import DTYPES
from kiln.pipeline.records import (
    CalibrationParams,
    EvalParams,
    ExportParams,
    IngestParams,
    QuantizeParams,
    ReferenceParams,
)
from kiln.placement.cost import StageWork
from kiln.placement.fit import MEMORY_UTILIZATION
from kiln.placement.model import kv_cache_bytes, paged_kv_cache, tp_degrees, vllm_defaults
from kiln.placement.weights import artifact_bytes, gguf_bytes, gguf_repacked_bytes, source_bytes
from kiln.quant.footprint import quantized_bytes

MiB = 1024 * 1024
KV_BYTES = 2  # a serving runtime's KV cache element (bf16)
# vLLM's CPU build holds more than the weights, the KV cache it reserves and its imports: its worker's peak (with
# the eval's own process) measured 1.25-1.59 × that sum (bench/results/scale.jsonl, 2026-11-26, 128-token windows:
# at Llama-3.2-1B's shape FP8 6.33 GiB for 4.33 planned, INT8-W8A8 6.72 for 4.33, INT4 4.88 for 3.89, trtllm's FP8
# 6.89 for 4.33; at Llama-3-8B's FP8 17.3 GiB for 11.9). The plan takes the highest.
VLLM_CPU_MEASURED = 1.6
# The Linears each of AWQ's smoothings balances in a decoder layer, by kind (llm-compressor's default mappings:
# input_layernorm -> q/k/v, v -> o, post_attention_layernorm -> gate/up of the MLP or of every expert, up -> down).
AWQ_MAPPINGS: tuple[frozenset[TensorKind], ...] = (
    frozenset({TensorKind.ATTN_Q, TensorKind.ATTN_K, TensorKind.ATTN_V, TensorKind.ATTN_QKV}),
    frozenset({TensorKind.ATTN_OUTPUT}),
    frozenset(
        {
            TensorKind.FFN_GATE,
            TensorKind.FFN_UP,
            TensorKind.FFN_GATE_UP,
            TensorKind.FFN_GATE_EXPS,
            TensorKind.FFN_UP_EXPS,
            TensorKind.FFN_GATE_SHEXP,
            TensorKind.FFN_UP_SHEXP,
        }
    ),
    frozenset({TensorKind.FFN_DOWN, TensorKind.FFN_DOWN_EXPS, TensorKind.FFN_DOWN_SHEXP}),
)
# The share of its device's memory a compute stage may fill holding a model (`PlanDevice.memory_budget`): the rest
# for the allocator's slack, the checkpoint's pages as they are read and, on the CPU, what else the machine runs.
HOLD_UTILIZATION = 0.8
# What a source's config.json may say its weights are stored in (`torch_dtype`, or `dtype` in transformers 5).
CONFIG_DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}


class Requirements(BaseModel):
    """One node's needs: `gpus` GPUs (0: it computes on the CPU) with `device_memory_bytes` each, and
    `memory_bytes` of host memory. `accelerator` is `<vendor>:<sku>` (`nvidia:h100`) where the stage needs
    that SKU (a runner's GPU eval, or a plan sized for a catalog GPU), else None."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: int = Field(ge=1)
    memory_bytes: int = Field(ge=0, description="host memory")
    accelerator: str | None = None
    runtime_env: str | None = Field(default=None, description="a runtime kiln's own environment lacks, pinned")
    # GPUs the stage computes on (Ray's `num_gpus`; tensor parallelism for a serving runtime); 0: the CPU.
    gpus: int = Field(default=0, ge=0)
    device_memory_bytes: int = Field(default=0, ge=0, description="per GPU")
    fits: bool = Field(default=True, description="whether the per-GPU share fits the GPU the plan is sized for")
    # How a transformers forward holds the model (`eval.runtimes.residency.hold`), which the memory above is
    # sized for; the stage holds it so. None: a stage that holds no model that way.
    weights: Residency | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _computed_agree(cls, data: Any, handler: ModelWrapValidatorHandler[Requirements]) -> Requirements:
        """Its own dump (a plan row's `requires`) reads back: `device` and `devices`, which it computes from `gpus`,
        are refused unless they are what it computes."""
        given: dict[str, Any] = {}
        if isinstance(data, dict):
            given = {k: data[k] for k in ("device", "devices") if k in data}
            data = {k: v for k, v in data.items() if k not in given}
        read = handler(data)
        computed = {k: getattr(read, k) for k in given}
        if computed != given:
            raise ValueError(f"{given} is not what {read.gpus} GPUs make ({computed})")
        return read
        given = {k: data[k] for k in ("device", "devices") if k in data}
        data = {k: v for k, v in data.items() if k not in given}
        gpus = data.get("gpus", 0)
        computed = {"device": "cuda" if gpus else "cpu", "devices": gpus or 1}
        if any(computed[k] != v for k, v in given.items()):
            raise ValueError(f"{given} is not what {gpus} GPUs make ({computed})")
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def device(self) -> DeviceKind:
        return "cuda" if self.gpus else "cpu"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def devices(self) -> int:
        """How many devices it computes on: its GPUs, or the one CPU."""
        return self.gpus or 1

    @property
    def sku(self) -> str | None:
        return self.accelerator.split(":", 1)[1] if self.accelerator else None

    def ray_resources(self) -> dict[str, float]:
        """The custom Ray resources a node must offer: `accelerator:<sku>` for an accelerator stage."""
        return {f"accelerator:{self.sku}": 1.0} if self.sku else {}


# ---------------------------------------------------------------------------------------------------------
# The device a plan is sized for.


@dataclass(frozen=True)
class GpuSpec:
    """A GPU the plan sizes for: its memory and how many one node has (the most a stage may ask for)."""

    name: str
    memory_bytes: int
    per_node: int
    sku: str | None = None  # the catalog's name, when sized from the catalog


@dataclass(frozen=True)
class PlanDevice:
    """Where the plan's compute stages compute: the CPU, or a GPU (`gpu` None: one of unknown memory, e.g.
    a Ray cluster's, planned from a driver that has none; then every GPU stage asks for one). `host_memory`:
    the memory of the machine the CPU stages run on (`core.device.host_memory_bytes`; None: unknown)."""

    kind: DeviceKind = "cpu"
    gpu: GpuSpec | None = None
    host_memory: int | None = None

    def memory_budget(self, kind: DeviceKind) -> int | None:
        """What a compute stage on a device of `kind` may fill holding a model: `HOLD_UTILIZATION` of the GPU's
        memory, or of the host's on the CPU; None where that memory is unknown (then it streams)."""
        memory = (self.gpu.memory_bytes if self.gpu is not None else None) if kind == "cuda" else self.host_memory
        return None if memory is None else int(HOLD_UTILIZATION * memory)


CPU_PLAN = PlanDevice()


def catalog_gpu(sku: str) -> GpuSpec:
    """A CUDA GPU of the hardware catalog (`kiln plan --gpu h100`): UNKNOWN_NAME for a name it lacks,
    INVALID_DEVICE for a device of another family (a TPU, an AMD GPU); both list the CUDA GPUs."""
    cuda = sorted(n for n, p in PROFILES.items() if p.family == "cuda")
    try:
        profile = get_profile(sku)
    except UnknownName:
        raise UnknownName(
            f"GPU {sku!r} is not in the hardware catalog; known CUDA GPUs: {', '.join(cuda)}",
            details={"gpu": sku[:64], "known": cuda},
        ) from None
    if profile.family != "cuda":
        raise InvalidDevice(
            f"GPU {sku!r} is a {profile.family} device, not CUDA; known CUDA GPUs: {', '.join(cuda)}",
            details={"gpu": sku, "family": profile.family, "known": cuda},
        )
    return GpuSpec(sku, int(profile.memory_gib * 1024**3), profile.devices_per_node, sku)


def torch_gpu(index: int = 0) -> GpuSpec:
    """The GPU torch sees at `index`: its name and memory; a node of as many as this machine has."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return GpuSpec(torch.cuda.get_device_name(index), int(props.total_memory), int(torch.cuda.device_count()))


def plan_device(device: Device, gpu: str | None = None, *, visible: int | None = None) -> PlanDevice:
    """What a plan on `device` is sized for: the CPU; for `cuda`, the catalog's `gpu` when named, else the GPU
    this machine has (`visible`: its CUDA device count, None asks torch), else a GPU of unknown memory."""
    if device.kind == "cpu":
        if gpu is not None:
            raise InvalidDevice(
                f"--gpu {gpu} names the GPU of --device cuda; the device is cpu", details={"gpu": gpu[:64]}
            )
        return PlanDevice(host_memory=host_memory_bytes())
    if gpu is not None:
        return PlanDevice("cuda", catalog_gpu(gpu))
    count = cuda_device_count() if visible is None else visible
    if (device.index or 0) < count:
        return PlanDevice("cuda", torch_gpu(device.index or 0))
    return PlanDevice("cuda")


def planning_device(spec: str | Device, gpu: str | None = None, *, visible: int | None = None) -> Device:
    """`--device` of `kiln plan`: `auto` is `cuda` when a GPU is named (`--gpu`) or visible, else the CPU; `cuda`
    needs either (DEVICE_UNAVAILABLE: there is nothing to size it from)."""
    from kiln.core.device import parse_device

    device = parse_device(spec) if isinstance(spec, str) else spec
    count = cuda_device_count() if visible is None else visible
    if device is None:
        return Device("cuda") if gpu is not None or count > 0 else CPU
    if device.kind == "cuda" and gpu is None and (device.index or 0) >= count:
        raise DeviceUnavailable(
            f"--device {device}: no such CUDA device here to size the plan from; name the GPU to plan for "
            "with --gpu (e.g. --gpu h100)",
            details={"device": str(device), "visible": count},
        )
    return device


# ---------------------------------------------------------------------------------------------------------
# The model.


@dataclass(frozen=True)
class Sizing:
    """What requirements are computed from: the model's shape and config, the bytes of one source weight,
    the eval's token budget (`eval.max_tokens`, `eval.window`, `eval.greedy_tokens`) and the plan's device."""

    shape: ModelShape
    config: Mapping[str, Any] = field(repr=False)
    weight_bytes: int
    max_tokens: int
    window: int
    greedy_tokens: int
    device: PlanDevice = CPU_PLAN
    shape_only: bool = False  # planned from config.json alone
    greedy_prompts: int = 4  # the prompts continued greedily (`eval.greedy_prompts`)
    # Each artifact's weight bytes, counted once a plan (a mixture of experts has ~10^5 tensors to count).
    _weights: dict[tuple[str, bool], int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of_source(
        cls, source: SourceModel, *, max_tokens: int, window: int, greedy_tokens: int, greedy_prompts: int = 4
    ) -> Sizing:
        """From a checked source: s, the bytes of one weight, those of the dtype most of its plain tensors'
        elements are stored in (bf16 for a bf16 model, whatever float32 norms or router biases it keeps; ties to the
        wider). A pre-quantized source's quantized tensors are not plain: their bytes are their layout's
        (`placement.weights.source_bytes`, from `ModelShape.stored_tensors`), and its plain tensors are what
        dequantized weights compute beside (DeepSeek-V3's and gpt-oss's bf16, beside DeepSeek's float32 correction
        biases)."""
        quantized = source.quantized.tensors if source.quantized is not None else {}
        elements: dict[int, int] = {}
        for name, t in source.tensors.items():
            if name not in quantized:
                size = DTYPES[t.dtype].itemsize
                elements[size] = elements.get(size, 0) + math.prod(t.shape)
        itemsize = max(elements, key=lambda size: (elements[size], size), default=2)
        return cls(
            source.shape, source.config, itemsize, max_tokens, window, greedy_tokens, greedy_prompts=greedy_prompts
        )

    @classmethod
    def of_config(
        cls,
        config: Mapping[str, Any],
        shape: ModelShape,
        *,
        max_tokens: int,
        window: int,
        greedy_tokens: int,
        greedy_prompts: int = 4,
    ) -> Sizing:
        """From config.json alone (a shape-only source): the weights' dtype from its `torch_dtype` (or
        `dtype`), bf16 when it says none; SOURCE_INVALID when it names another."""
        key = "torch_dtype" if "torch_dtype" in config else "dtype"
        dtype = config.get(key, "bfloat16")
        if dtype not in CONFIG_DTYPES:
            raise SourceInvalid(
                f"config.json: {key}={str(dtype)[:32]!r}; a source's weights are {', '.join(CONFIG_DTYPES)}",
                details={"file": "config.json", "field": key},
            )
        return cls(
            shape,
            config,
            CONFIG_DTYPES[dtype],
            max_tokens,
            window,
            greedy_tokens,
            shape_only=True,
            greedy_prompts=greedy_prompts,
        )

    @cached_property
    def record(self) -> ShapeRecord:
        """The shape as sizing reads it (`placement.model`)."""
        return self.shape.record()

    @cached_property
    def _layer_specs(self) -> list[TensorSpec]:
        """The largest decoder layer's tensors (a sparse layer's, with every expert, in a mixture of experts)."""
        sh = self.shape
        sparse = sh.moe.sparse_layers[0] if sh.moe is not None and sh.moe.sparse_layers else None
        dense = next((i for i in range(sh.num_layers) if not sh.is_sparse(i)), None)
        layers = [sh.layer_tensors(i) for i in (dense, sparse) if i is not None]
        return max(layers, key=lambda ts: sum(t.elements for t in ts))

    @property
    def _layer(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.shape for t in self._layer_specs}

    @property
    def layer_params(self) -> int:
        """P_L: the parameters of the largest decoder layer (norms, biases and every expert included)."""
        return sum(t.elements for t in self._layer_specs)

    @property
    def layer_expert_params(self) -> int:
        """The parameters of the largest decoder layer's routed experts (0 for a dense model)."""
        return sum(t.elements for t in self._layer_specs if t.expert is not None)

    @property
    def layer_linears(self) -> list[TensorSpec]:
        """The Linear weights of the largest decoder layer (every expert's included)."""
        return [t for t in self._layer_specs if t.quantizable]

    @property
    def largest_tensor_bytes(self) -> int:
        """The largest source tensor's bytes: the embedding (or lm_head), or an MLP projection."""
        embedding = self.shape.vocab_size * self.shape.hidden_size
        return self.weight_bytes * max(embedding, *(math.prod(s) for s in self._layer.values()))

    def activations(self, tokens: int) -> int:
        """A(n): float32 activations of `tokens` tokens through one decoder layer (a sparse layer's MLP: each
        token's k experts)."""
        sh = self.shape
        width = sh.intermediate_size
        if sh.moe is not None:
            width = max(width, sh.moe.experts_per_token * sh.moe.intermediate_size)
        return 4 * tokens * (4 * sh.hidden_size + 3 * width)

    @property
    def context(self) -> int:
        """The longest sequence an eval runs: a window, or a prompt and its greedy continuation."""
        return self.window + self.greedy_tokens

    @property
    def forced_tokens(self) -> int:
        """The tokens of a teacher-forced eval's sequences: each prompt and the reference's continuation."""
        return self.greedy_prompts * (DEFAULT_PROMPT_TOKENS + self.greedy_tokens)

    @property
    def params(self) -> int:
        """N: the model's parameters."""
        return sum(t.elements for t in self.shape.tensors())

    @property
    def streams(self) -> bool:
        """Whether the transformers forward can stream this architecture by layer (`eval.runtimes.layer_stream`)."""
        return self.config.get("model_type") in STREAMED_MODEL_TYPES

    @property
    def compare_bytes(self) -> int:
        """C: an eval's window-by-window comparison on the host."""
        return 16 * self.window * self.shape.vocab_size

    def kv_cache_bytes(self, tokens: int, element: int = KV_BYTES, tp: int = 1) -> int:
        """Keys and values of every layer for one sequence of `tokens`, per device under `tp` (`placement.model`)."""
        return kv_cache_bytes(self.record, tokens, tp=tp, element_bytes=element)

    def paged_kv_bytes(self, tokens: int, tp: int = 1) -> int:
        """A serving runtime's KV cache of one sequence of `tokens` on one of `tp` GPUs of the plan's device, paged as
        vLLM pages it there (`placement.model.PagedKvCache`, `vllm_defaults` of that GPU)."""
        gpu = self.device.gpu
        serving = vllm_defaults("cuda", gpu.memory_bytes / 2**30 if gpu else 0.0, gpu.name if gpu else "")
        paged = paged_kv_cache(
            self.record, block_size=serving.block_size, in_flight_tokens=serving.in_flight_tokens, tp=tp
        )
        return paged.bytes(tokens)

    def repacked_bytes(self, quant: str) -> int:
        """What llama.cpp's CPU backend holds besides the mapped file: its repacked copy of the tensors its kernels
        interleave (`placement.weights.gguf_repacked_bytes`); 0 for a quant that is not a GGUF type."""
        return gguf_repacked_bytes(self.shape, quant) if quant in GGUF_QUANTS else 0

    def weights_bytes(self, quant: str, runtime: str) -> int:
        """The artifact's weights (`placement.weights.artifact_bytes`)."""
        key = (quant, runtime == "llama.cpp")  # a GGUF file's, or the scheme's checkpoint for any other runtime
        if key not in self._weights:
            self._weights[key] = artifact_bytes(self.shape, self.config, self.weight_bytes, quant, runtime)
        return self._weights[key]


# ---------------------------------------------------------------------------------------------------------
# Footprints: what a stage holds while it computes, beyond its imports.


@dataclass(frozen=True)
class Footprint:
    """`working`: bytes on the device the stage computes on (a GPU, or host memory on the CPU); `host`:
    bytes in host memory besides (what it reads and brings back)."""

    working: int
    host: int = 0
    weights: Residency | None = None  # how it holds the model, where a transformers forward holds one


def streamed(factor: float) -> Callable[[Sizing, Any], Footprint]:
    """A streaming stage: `factor` × the largest tensor, on the CPU."""
    return lambda sizing, node: Footprint(math.ceil(factor * sizing.largest_tensor_bytes))


def streamed_requirements(stage: str, sizing: Sizing, copies: float) -> Requirements:
    """A streaming stage's needs on the CPU when it holds `copies` of the largest tensor (an export, by its target's
    `export_tensor_copies`)."""
    needs = _stage(stage)
    return on_device(needs.cpus, needs.base_mib, streamed(copies)(sizing, None), "cpu", sizing)


def nothing(sizing: Sizing, node: Any) -> Footprint:
    return Footprint(0)


def layer_streamed(sizing: Sizing, tokens: int) -> Footprint:
    """The reference (and a transformers eval): one decoder layer at a time in float32, the hidden states of
    `tokens` through it. A mixture of experts' per-expert tensors are merged into transformers' fused 3-D
    experts as the layer loads, which holds the experts twice for a moment (the per-expert and the stacked
    copies): a pass over a Qwen3-MoE layer of 32 experts, 214 MB in float32 read from 107 MB of bf16, raised
    the peak RSS by 474 MiB, not 321."""
    sh = sizing.shape
    w, v, h = sizing.window, sh.vocab_size, sh.hidden_size
    working = (
        4 * sizing.layer_params
        + 4 * sizing.layer_expert_params
        + 4 * min(v, HEAD_BLOCK) * h
        + 8 * tokens * h
        + sizing.activations(w)
        + 4 * w * v
    )
    return Footprint(working, sizing.weight_bytes * sizing.layer_params + 4 * w * v)


def held_whole(sizing: Sizing, kind: DeviceKind) -> Footprint:
    """The model loaded whole in float32 (`TransformersRuntime`: read on the host, then moved to a GPU), one
    window through it and its logits. A pre-quantized source is dequantized as it loads, one layer's experts
    twice for a moment: DeepSeek-V3's per-expert tensors dequantized then stacked by transformers' loader, a
    gpt-oss MXFP4 stack decoded then transposed (`formats.prequantized.dequantize`)."""
    w = sizing.window
    weights = 4 * sizing.params
    loading = 4 * sizing.layer_expert_params if sizing.shape.source_quant is not None else 0
    return Footprint(
        weights + max(loading, sizing.activations(w) + 4 * w * sizing.shape.vocab_size),
        weights if kind == "cuda" else 0,
    )


def holding(
    sizing: Sizing, kind: DeviceKind, base_mib: int, whole: Footprint, streamed: Footprint, resident: int
) -> Footprint:
    """The footprint of a transformers forward, holding the model as `eval.runtimes.residency.hold` decides for
    the plan's memory budget on a device of `kind` (on the CPU the stage's base and host bytes count against
    it too): `whole`, or `streamed` with up to `resident` bytes of cast layers kept (on the device)."""

    def need(fp: Footprint) -> int:
        return fp.working if kind == "cuda" else base_mib * MiB + fp.working + fp.host

    residency = hold(
        sizing.device.memory_budget(kind),
        streams=sizing.streams,
        whole=need(whole),
        streamed=need(streamed),
        resident=resident,
    )
    if residency.whole:
        return replace(whole, weights=residency)
    return Footprint(streamed.working + residency.resident_bytes, streamed.host, residency)


def reference_forward(sizing: Sizing, kind: DeviceKind) -> Footprint:
    """The reference: its windows' logits and its own greedy continuation, which decodes token by token, so
    a streamed reference keeps what the budget allows of every layer and the head resident (float32)."""
    sh = sizing.shape
    head = sh.vocab_size * sh.hidden_size
    resident = 4 * (
        sizing.params - (0 if sh.tie_word_embeddings else head)
    )  # the layers and the head, not the embedding
    base = STAGE_NEEDS["reference"].base_mib
    return holding(sizing, kind, base, held_whole(sizing, kind), layer_streamed(sizing, sizing.max_tokens), resident)


def calibrated(sizing: Sizing, calibration: CalibrationParams, method: str) -> Footprint:
    """llm-compressor's pipelines: one layer, one sample and the method's working set (GPTQ's Hessians and
    the widest one's factorisation; AWQ's grid search over its largest mapping; FP4's min-max observers:
    one Linear's float32 copy). Data-free (weight-only FP4) has no samples."""
    sh = sizing.shape
    samples, seq_len = calibration.samples or 0, calibration.seq_len or 0
    element = 2 if calibration.compute_dtype == "bfloat16" else 4
    linears = [t.shape for t in sizing.layer_linears]
    if method == "minmax":
        working = element * sizing.layer_params + 4 * max(math.prod(s) for s in linears)
        if samples:
            working += sizing.activations(seq_len)
        return Footprint(working, 8 * samples * seq_len * sh.hidden_size)
    if method == "gptq":
        widest = max(linears, key=lambda s: (s[1], s[0]))
        method_bytes = sum(4 * s[1] * s[1] for s in linears) + 4 * widest[1] ** 2 + 4 * math.prod(widest)
    else:
        balanced = max(sum(t.elements for t in sizing.layer_linears if t.kind in group) for group in AWQ_MAPPINGS)
        method_bytes = (element + 12) * balanced
    working = element * sizing.layer_params + method_bytes + sizing.activations(seq_len)
    host = 8 * samples * seq_len * sh.hidden_size
    if method == "awq":
        host += 4 * samples * seq_len * (2 * sh.hidden_size + sh.num_heads * sh.head_dim + sh.intermediate_size)
    return Footprint(working, host)


def transformers_forward(sizing: Sizing, quant: str, kind: DeviceKind, base_mib: int) -> Footprint:
    """A transformers eval: the artifact whole in float32 where it fits the plan's budget (`holding`), else one
    layer at a time (the reference's footprint, its windows and teacher-forced sequences through each layer),
    keeping the float32 head resident where the budget allows (it is applied to every window; no layer is read
    twice); the window-by-window comparison on the host."""
    whole = held_whole(sizing, kind)
    streamed = layer_streamed(sizing, sizing.max_tokens + sizing.forced_tokens)
    compare = sizing.compare_bytes
    return holding(
        sizing,
        kind,
        base_mib,
        Footprint(whole.working, whole.host + compare),
        Footprint(streamed.working, streamed.host + compare),
        4 * sizing.shape.vocab_size * sizing.shape.hidden_size,
    )


def jax_forward(sizing: Sizing, quant: str) -> Footprint:
    """The JAX forward (`eval.runtimes.jax_runtime`): the checkpoint restored one decoder layer at a time (a
    checkpoint of at most `RESIDENT_BYTES` whole), each weight cast to float32 as used. A sparse layer is
    restored with every expert (the orbax layout stacks them per layer), so P_L counts them all, and its mixture
    runs densely: every expert on every token of a window, [W, experts, ...] float32 activations besides A(W).
    Multi-head latent attention caches latents (the KV cache's MLA width) and expands them on every call to each
    head's keys and values over the context, [context, heads, qk_head_dim + v_head_dim] in float32."""
    from kiln.eval.runtimes.base import RESIDENT_BYTES

    sh = sizing.shape
    w, v, h = sizing.window, sh.vocab_size, sh.hidden_size
    checkpoint = sizing.weights_bytes(quant, "jax")
    restored = checkpoint if checkpoint <= RESIDENT_BYTES else sizing.weight_bytes * (sizing.layer_params + v * h)
    # The dense mixture's gate, up and their product [W, E, f_e], and each expert's output [W, E, h].
    experts = 4 * w * sh.moe.experts * (3 * sh.moe.intermediate_size + h) if sh.moe is not None else 0
    mla = 4 * sizing.context * sh.num_heads * (sh.head_dim + sh.mla.v_head_dim) if sh.mla is not None else 0
    working = (
        restored
        + 4 * sizing.layer_params
        + 4 * min(v, HEAD_BLOCK) * h
        + 16 * sizing.max_tokens * h
        + sizing.kv_cache_bytes(sizing.context, element=4)
        + sizing.activations(w)
        + experts
        + mla
        + 4 * w * v
    )
    return Footprint(working, sizing.compare_bytes)


@dataclass(frozen=True)
class Served:
    """A serving runtime's replica: its tensor-parallel degree and each device's share."""

    tp: int
    per_device: int
    fits: bool


def tensor_parallel(sizing: Sizing, weights: int, gpu: GpuSpec | None) -> Served:
    """The smallest power of two TP (dividing the attention heads, and the KV heads or replicating them evenly,
    up to `gpu.per_node`) whose share of `weights` and of one sequence's KV cache fits `MEMORY_UTILIZATION`
    of the GPU's memory; the largest when none does. A GPU of unknown memory: TP 1."""

    def share(tp: int) -> int:
        return -(-weights // tp) + sizing.paged_kv_bytes(sizing.context, tp=tp)

    if gpu is None:
        return Served(1, share(1), True)
    usable = int(MEMORY_UTILIZATION * gpu.memory_bytes)
    degrees, _ = tp_degrees(sizing.record, gpu.per_node)
    for tp in degrees:
        if share(tp) <= usable:
            return Served(tp, share(tp), True)
    return Served(degrees[-1], share(degrees[-1]), False)


# ---------------------------------------------------------------------------------------------------------
# Per stage, as data (per runtime: `eval.runtimes.facts.RUNTIME_FACTS`).


@dataclass(frozen=True)
class StageNeeds:
    """A stage's cores, what its imports take, and what it holds beyond them (a function of the model)."""

    cpus: int
    base_mib: int
    footprint: Callable[[Sizing, Any], Footprint]


STAGE_NEEDS: dict[str, StageNeeds] = {
    "ingest": StageNeeds(1, 200, streamed(2)),
    "reference": StageNeeds(2, 600, lambda sizing, node: reference_forward(sizing, placed_kind(node))),
    # Round-to-nearest: measured at 8B (bench/results/scale.jsonl) 1.1-1.2 GiB over its start, 1.2 copies of the
    # 1.05 GB embedding; at 1B 0.4-0.5 GiB, one copy of its 0.53 GB embedding.
    "quantize": StageNeeds(1, 450, streamed(2)),
    "quantize-calibrated": StageNeeds(2, 650, nothing),  # its footprint: `calibrated`, from the node's params
    "prepare": StageNeeds(1, 400, nothing),
    "export": StageNeeds(1, 500, streamed(4)),  # by its target's `export_tensor_copies` (`pipeline.stages.export`)
    "eval": StageNeeds(2, 600, nothing),  # its footprint: its runtime's, `eval_requirements`
    # A target's derived stage on a GPU runner (a GPU eval, an engine build): a serving runtime's replica,
    # `runner_requirements`.
    "runner": StageNeeds(4, 2000, nothing),
    "publish": StageNeeds(1, 150, nothing),
    "seal": StageNeeds(1, 150, nothing),
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


def _stage(stage: str) -> StageNeeds:
    if stage not in STAGE_NEEDS:
        raise UnknownName(f"no requirements known for stage {stage!r}", details={"known": list(STAGE_NEEDS)})
    return STAGE_NEEDS[stage]


def _runtime(runtime: str) -> RuntimeFacts:
    """What the planner reads of a runtime: its row of `eval.runtimes.facts.RUNTIME_FACTS`."""
    if runtime not in RUNTIME_FACTS:
        raise UnknownName(f"no requirements known for runtime {runtime!r}", details={"known": list(RUNTIME_FACTS)})
    return RUNTIME_FACTS[runtime]


def on_device(cpus: int, base_mib: int, footprint: Footprint, kind: DeviceKind, sizing: Sizing) -> Requirements:
    """A stage computing on one device of `kind`: on a GPU its working set there (fitting the GPU's memory),
    its base and host bytes in host memory; on the CPU all of it in host memory."""
    base = base_mib * MiB
    if kind == "cpu":
        return Requirements(
            cpus=cpus, memory_bytes=base + footprint.working + footprint.host, weights=footprint.weights
        )
    gpu = sizing.device.gpu
    return Requirements(
        cpus=cpus,
        memory_bytes=base + footprint.host,
        accelerator=accelerator(gpu.sku) if gpu is not None and gpu.sku is not None else None,
        gpus=1,
        device_memory_bytes=footprint.working,
        fits=gpu is None or footprint.working <= gpu.memory_bytes,
        weights=footprint.weights,
    )


def placed_kind(node: Any) -> DeviceKind:
    """The device kind a node was placed on: its `device` param (`pipeline.placement`), else the CPU."""
    kind = node.params.get("device", "cpu") if node is not None else "cpu"
    if kind == "cpu" or kind == "cuda":
        return "cuda" if kind == "cuda" else "cpu"
    raise InvalidDevice(f"{node.id}: placed on {kind!r}; known: cpu, cuda")


def requirements(stage: str, sizing: Sizing, node: Any = None) -> Requirements:
    """The needs of a `node` of `stage` (its row of `STAGE_NEEDS`), on the device it was placed on."""
    needs = _stage(stage)
    return on_device(needs.cpus, needs.base_mib, needs.footprint(sizing, node), placed_kind(node), sizing)


def calibrated_requirements(
    sizing: Sizing, calibration: CalibrationParams, method: str, device: DeviceKind
) -> Requirements:
    """A quantize node llm-compressor computes (`method` gptq, awq or minmax) on `device`."""
    needs = _stage("quantize-calibrated")
    return on_device(needs.cpus, needs.base_mib, calibrated(sizing, calibration, method), device, sizing)


def eval_requirements(
    sizing: Sizing, runtime: str, quant: str, *, device: DeviceKind = "cpu", version: str | None = None
) -> Requirements:
    """An eval of a `quant` artifact in `runtime`: on `device` for the runtimes kiln runs on the stage's device;
    a serving runtime (vLLM) on the plan's device, over as many GPUs as its weights need."""
    rt = _runtime(runtime)
    stage = _stage("eval")
    if rt.vendor is not None:  # a runner's runtime (tensorrt_llm): here the eval records "not evaluated"
        return on_device(stage.cpus, stage.base_mib, Footprint(0), "cpu", sizing)
    base = rt.base_mib if rt.base_mib is not None else stage.base_mib
    env = f"{rt.runtime_env}=={version}" if rt.runtime_env and version else rt.runtime_env
    if rt.memory_model == "serving":
        req = serving(sizing, quant, runtime, stage.cpus, base, sizing.device, host=sizing.compare_bytes)
        if req.gpus and rt.gpu_runtime_env is not None:
            env = rt.gpu_runtime_env
    elif rt.memory_model == "mapped":
        weights = sizing.weights_bytes(quant, runtime) + sizing.repacked_bytes(quant)
        footprint = Footprint(weights + sizing.kv_cache_bytes(sizing.context) + sizing.compare_bytes)
        req = on_device(stage.cpus, base, footprint, "cpu", sizing)
    elif rt.memory_model == "jax":
        req = on_device(stage.cpus, base, jax_forward(sizing, quant), device, sizing)
    else:
        req = on_device(stage.cpus, base, transformers_forward(sizing, quant, device, base), device, sizing)
    return req.model_copy(update={"runtime_env": env})


def serving(
    sizing: Sizing, quant: str, runtime: str, cpus: int, base_mib: int, device: PlanDevice, *, host: int = 0
) -> Requirements:
    """A serving runtime's replica of a `quant` artifact on `device`: over TP GPUs (`tensor_parallel`), or on
    the CPU with the weights and the KV cache in host memory. Host memory also holds its largest tensor as
    it loads the checkpoint, and `host`."""
    weights = sizing.weights_bytes(quant, runtime)
    base = base_mib * MiB + sizing.largest_tensor_bytes + host
    if device.kind == "cpu":
        kv = kv_cache_reservation(sizing.record, sizing.context + 1, 4)
        return Requirements(cpus=cpus, memory_bytes=math.ceil(VLLM_CPU_MEASURED * (base + weights + kv)))
    served = tensor_parallel(sizing, weights, device.gpu)
    sku = device.gpu.sku if device.gpu is not None else None
    return Requirements(
        cpus=cpus,
        memory_bytes=base,
        accelerator=accelerator(sku) if sku is not None else None,
        gpus=served.tp,
        device_memory_bytes=served.per_device,
        fits=served.fits,
    )


def runner_requirements(
    sizing: Sizing, runtime: str, quant: str, sku: str, version: str, *, host: int = 0
) -> Requirements:
    """A target's derived stage, run by a GPU runner of `sku` with `runtime` pinned at `version` (a GPU eval,
    an engine build): a serving replica of the `quant` artifact there, and `host` bytes on the host besides."""
    needs = _stage("runner")
    rt = _runtime(runtime)
    req = serving(sizing, quant, runtime, needs.cpus, needs.base_mib, PlanDevice("cuda", catalog_gpu(sku)), host=host)
    return req.model_copy(update={"accelerator": accelerator(sku), "runtime_env": f"{rt.runtime_env}=={version}"})


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


# ---------------------------------------------------------------------------------------------------------
# Disk and time (`placement.cost`): what each stage writes, reads and computes.


def ingest_written_bytes(source_bytes: int, copy: bool) -> int:
    """What ingest leaves in the work dir: links to the source (a clone, hard or symbolic link: no bytes of its
    weights, `pipeline.stages.ingest`), or a copy of them where the recipe asks (`source_copy: true`)."""
    return source_bytes if copy else 0


def reference_rows_bytes(sizing: Sizing, max_entries: int) -> int:
    """The reference's stored distributions, at most: per scored token its kept tokens (12 bytes each, at most
    `max_entries`), or its float32 logits where those take fewer bytes (`eval.reference_rows`)."""
    v = sizing.shape.vocab_size
    return sizing.max_tokens * min(12 * min(max_entries, v), 4 * v)


def stage_kind(node: Any) -> str:
    """The kind of work `node` does, as its time is measured (`placement.cost.BUILD_HOST_TIMES`), most general first:
    its stage; for a quantize whether it calibrates (`quantize:calibrated`, a forward of its samples) and its
    scheme; for an export the target it writes (`export:gguf`; `export:gguf-llama.cpp` for a type llama.cpp's
    quantizer makes) and its quant; for an eval the runtime it runs in and the artifact's quant
    (`eval:vllm:fp8`). An estimate takes the most specific kind measured (`placement.cost.estimate`)."""
    from kiln.targets.base import get_target

    stage = node.stage.name
    if stage == "quantize":
        scheme = QuantizeParams.model_validate(node.params).scheme
        return f"quantize{':calibrated' if scheme.calibrated else ''}:{scheme.name}"
    if stage == "export":
        export = ExportParams.model_validate(node.params)
        spec = get_target(export.target)
        gguf = GGUF_QUANTS.get(export.quant) if spec.runtime == "llama.cpp" else None
        writer = f"export:{export.target}" + ("-llama.cpp" if gguf is not None and gguf.llama_ftype else "")
        return f"{writer}:{export.quant}"
    if stage == "eval":
        ev = EvalParams.model_validate(node.params)
        return f"eval:{ev.runtime}:{ev.quant}"
    return str(stage)


def stage_work(node: Any, sizing: Sizing, read_bytes: int) -> StageWork:
    """What `node` writes and computes on the model of `sizing`, reading `read_bytes` (what its inputs hold, or
    for ingest the source): ingest links (or copies) the source (`ingest_written_bytes`); the reference its rows
    and a forward of T tokens (2·N·T FLOPs); a quantize node the Linears it quantizes
    (`quant.footprint.quantized_bytes`; calibration a forward of its samples); an export its artifact's bytes (a
    GGUF llama.cpp quantizes, the lossless intermediate besides, removed when it ends); an eval a forward of T
    tokens. Reports and records: nothing."""
    from kiln.targets.base import get_target

    params = sum(t.elements for t in sizing.shape.tensors())
    stage = node.stage.name
    if stage == "ingest":
        copied = IngestParams.model_validate(node.params).copy_source
        return StageWork(read_bytes, ingest_written_bytes(read_bytes, copied))
    if stage == "prepare":  # the tokenizer and the reference's vocabulary, not the weights
        return StageWork()
    if stage == "reference":
        return StageWork(
            read_bytes,
            reference_rows_bytes(sizing, ReferenceParams.model_validate(node.params).max_entries),
            flops=2 * params * sizing.max_tokens,
        )
    if stage == "quantize":
        quantize = QuantizeParams.model_validate(node.params)
        scheme, calibration = quantize.scheme, quantize.calibration or CalibrationParams()
        tokens = calibration.tokens
        try:
            written = quantized_bytes(sizing.config, scheme.name, scheme.lm_head)
        except KilnError:  # a scheme quant.catalog does not name (a test's): sized as its whole checkpoint
            written = sizing.weights_bytes(scheme.name, "transformers")
        # llm-compressor calibrates a pre-quantized source from a dequantized copy in its compute dtype
        # (`formats.hf_model.write_dequantized`), removed when the stage ends.
        copy = scheme.by_llmcompressor and sizing.shape.source_quant is not None
        element = 2 if calibration.compute_dtype == "bfloat16" else 4
        return StageWork(read_bytes, written, element * params if copy else 0, flops=2 * params * tokens)
    if stage == "export":
        export = ExportParams.model_validate(node.params)
        spec = get_target(export.target)
        written = sizing.weights_bytes(export.quant, spec.runtime)
        gguf = GGUF_QUANTS.get(export.quant) if spec.runtime == "llama.cpp" else None
        scratch = 0
        if gguf is not None and gguf.llama_ftype:  # the lossless intermediate: the source's floats (a release's
            # pre-quantized weights dequantized into bf16: targets.gguf.convert.plan_tensors)
            scratch = (
                gguf_bytes(sizing.shape, "bf16")
                if sizing.shape.source_quant is not None
                else source_bytes(sizing.shape, sizing.weight_bytes)
            )
        return StageWork(read_bytes, written, scratch)
    if stage == "eval":
        return StageWork(read_bytes, flops=2 * params * sizing.max_tokens)
    return StageWork(read_bytes)
