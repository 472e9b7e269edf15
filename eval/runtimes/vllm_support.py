"""What vLLM runs where, as data: which architectures it serves (`architecture_limitation`: the family record's
`vllm` mapping, and the layouts vLLM refuses), what a bundle's config asks for (its weight schemes, an FP8 KV
cache, routed experts), what vLLM's CPU build cannot run on this machine (`CPU_LIMITS` for its Linear layers,
`CPU_EXPERTS_LIMITS` for a mixture's experts, against its capabilities and the worker's kernels) and the
activation dtype it computes a bundle in there (`COMPUTE_DTYPES`), and what its CUDA build runs per GPU
generation (`CUDA_KERNELS`: natively, through a stand-in kernel, or not at all).
`eval.runtimes.vllm_runtime` asks these before it loads anything, so a bundle vLLM cannot run is recorded as not
evaluated, with the reason.

Pure: no vLLM, no torch; the CPU facts come from `eval.runtimes.capabilities`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError
from kiln.eval.runtimes.capabilities import VllmCapabilities
from kiln.formats.architectures import ARCHITECTURES
from kiln.formats.architectures.record import Architecture
from kiln.formats.architectures.shape import ModelShape


@dataclass(frozen=True)
class WeightScheme:
    """What a compressed-tensors config group says of the weights and activations of its layers."""

    weight_type: str  # "int" or "float" (FP8 only at 8 bits: an FP4 group is float at 4)
    weight_bits: int
    weight_strategy: str  # "tensor", "channel", "group", "block"
    activations: bool  # activations quantized too (W8A8) or not (weight-only)
    group_size: int | None = None  # elements per scale of a group strategy (NVFP4: 16, MXFP4: 32)

    @classmethod
    def from_group(cls, group: Any) -> WeightScheme:
        weights = group.get("weights") if isinstance(group, dict) else None
        bits = weights.get("num_bits") if isinstance(weights, dict) else None
        if not isinstance(weights, dict) or not isinstance(bits, int) or isinstance(bits, bool):
            raise InvalidInput(
                "a compressed-tensors config group needs `weights` with an integer `num_bits`",
                code=Codes.BUNDLE_CONFIG_INVALID,
            )
        size = weights.get("group_size")
        return cls(
            weight_type=str(weights.get("type")),
            weight_bits=bits,
            weight_strategy=str(weights.get("strategy")),
            activations=bool(group.get("input_activations")),
            group_size=size if isinstance(size, int) and not isinstance(size, bool) else None,
        )


def int8_w8a8(scheme: WeightScheme) -> bool:
    """Int8 weights and int8 activations: what vLLM's CPU build runs through its int8 GEMM."""
    return scheme.weight_type == "int" and scheme.weight_bits == 8 and scheme.activations


@dataclass(frozen=True)
class Limitation:
    """A scheme vLLM's CPU backend runs only with a capability (`kernel:<op>` in its build, `amx` usable
    here, `fp8_matmul`: torch's FP8 matmul usable here, `int8_exact`: an int8 GEMM that sums in int32
    here), or never (`never`); `reason` is what the eval records when it is missing."""

    scheme: str
    matches: Callable[[WeightScheme], bool]
    needs: str
    reason: str


def _fp8_block(s: WeightScheme) -> bool:
    return s.weight_type == "float" and s.weight_bits == 8 and s.weight_strategy == "block"


def _int4_weight_only(s: WeightScheme) -> bool:
    return s.weight_type == "int" and s.weight_bits == 4 and not s.activations


# Sources: vllm 0.32.0 model_executor/kernels/linear/__init__.py (init_nvfp4_linear_kernel, init_mxfp4_linear_kernel:
# no CPU entry), model_executor/kernels/linear/mixed_precision/cpu.py (CPUWNA16: uint4/uint4b8 only,
# through torch.ops._C.cpu_gemm_wna16) and kernels/linear/scaled_mm/cpu.py (block FP8: AMX kernels only);
# each reason was seen as vLLM's own load error on this machine kind (AMD EPYC, AVX2).
CPU_LIMITS: tuple[Limitation, ...] = (
    Limitation(
        "FP4",
        lambda s: s.weight_type == "float" and s.weight_bits == 4,
        "never",
        "vLLM has no CPU kernel for NVFP4 or MXFP4 (its load fails: 'Failed to find a kernel that can implement "
        "the NVFP4 linear layer', 'Marlin FP4 not available'); they run on NVIDIA sm80+ (Marlin FP4, natively on "
        "Blackwell) and AMD gfx950: deferred to such a runner",
    ),
    Limitation(
        "W4A16",
        _int4_weight_only,
        "kernel:cpu_gemm_wna16",
        "this vLLM build has no cpu_gemm_wna16 kernel, which it runs 4-bit weight-only layers with on CPU",
    ),
    Limitation(
        "int8 W8A16",
        lambda s: s.weight_type == "int" and s.weight_bits == 8 and not s.activations,
        "never",
        "vLLM's CPU weight-only kernel (CPUWNA16) takes 4-bit weights only; int8 weight-only has no CPU kernel",
    ),
    Limitation(
        "FP8 W8A8",
        lambda s: s.weight_type == "float" and s.weight_bits == 8 and s.weight_strategy != "block" and s.activations,
        "fp8_matmul",
        "vLLM runs per-channel FP8 W8A8 on CPU through torch._scaled_mm, which has no usable FP8 matmul here",
    ),
    Limitation(
        "int8 W8A8",
        int8_w8a8,
        "int8_exact",
        "vLLM runs int8 W8A8 on this CPU through oneDNN's int8 GEMM, which adds u8 x s8 product pairs in "
        "saturating 16-bit integers without VNNI: its figures would be the kernel's clipping, not the bundle's",
    ),
    Limitation(
        "block FP8",
        _fp8_block,
        "amx",
        "vLLM runs block-scaled FP8 on CPU with AMX kernels only (CPUFp8BlockScaledMMKernel)",
    ),
)


@dataclass(frozen=True)
class ExpertsShape:
    """A mixture's routed experts as vLLM's fused MoE layer sees them: the width of their input (`hidden_size`)
    and of each expert's gated MLP (`intermediate_size`)."""

    hidden_size: int
    intermediate_size: int


# Every CPU experts kernel of vllm 0.32.0 packs the experts' input dimension in tiles of 32
# (fused_moe/experts/cpu_moe.py: CPUUnquantizedExperts.output_alignment, which pads the intermediate dimension
# but not the hidden one; CPUExpertsInt8's VNNI prepack). Seen here: a Qwen3-MoE of hidden size 48 fails with
# "No Unquantized MoE backend supports the deployment configuration".
EXPERTS_HIDDEN_MULTIPLE = 32


@dataclass(frozen=True)
class ExpertsLimitation(Limitation):
    """A scheme vLLM's CPU build runs a mixture's experts in only with a capability (`amx`: AMX tiles used here,
    which every quantized CPU experts kernel of x86 requires), or never; `intermediate_multiple`: the experts'
    intermediate size that kernel takes a multiple of; `stand_in`: where it runs, what it computes instead of
    the bundle's own arithmetic (named in the eval's runtime version), and `unless` the worker's hello flag
    under which it computes the bundle's own."""

    intermediate_multiple: int = 1
    stand_in: str = ""
    unless: str = ""


# How vllm 0.32.0's CPU build runs a mixture's experts, scheme by scheme: the fused-MoE oracles
# (model_executor/layers/fused_moe/oracle/{unquantized,fp8,int8,int_wna16,nvfp4,mxfp4}.py pick the first experts
# class whose `is_supported_config` accepts the layer), compressed_tensors_moe/compressed_tensors_moe.py (which
# method a config group gets) and fused_moe/experts/cpu_moe.py (the CPU classes and what each requires). On x86
# the unquantized experts run everywhere (CPUUnquantizedExperts, any float dtype; AMX's only with bf16); every
# quantized CPU experts class requires AMX tiles (`torch.cpu._is_amx_tile_supported`), and the Zen classes
# (ZenCPUExpertsInt8, ZentorchExpertsInt4) a zentorch that vLLM's CPU environment does not install. Each
# refusal quoted was seen as vLLM's load error here (AMD EPYC with AVX-512 and VNNI, no AMX), on Qwen3-MoE and
# Mixtral (tests/eval/test_vllm_families.py loads each scheme); where a Linear layer's limit refuses a scheme too,
# vLLM meets that one first.
CPU_EXPERTS_LIMITS: tuple[ExpertsLimitation, ...] = (
    ExpertsLimitation(
        "per-channel FP8",
        lambda s: s.weight_type == "float" and s.weight_bits == 8 and s.weight_strategy != "block",
        "never",
        "vLLM's CPU experts take FP8 weights in 128x128 blocks only (CPUExpertsFp8 and CPUExpertsFp8W8A8 accept "
        "kFp8Static128BlockSym; its FP8 MoE oracle finds no backend for per-channel scales on a CPU, with AMX or "
        "without; its load fails: 'Unsupported FP8 MoE backend: NONE'): a mixture's per-channel FP8 experts run on "
        "NVIDIA GPUs",
    ),
    ExpertsLimitation(
        "block FP8",
        _fp8_block,
        "amx",
        "vLLM runs block-FP8 experts on CPU with AMX kernels only (CPUExpertsFp8, CPUExpertsFp8W8A8)",
        stand_in="block-FP8 experts with bf16 activations (CPUExpertsFp8, W8A16)",
        unless="amx_fp8",  # CPUExpertsFp8W8A8 quantizes the activations as the bundle does, with AMX-FP8
    ),
    ExpertsLimitation(
        "int8 W8A8",
        int8_w8a8,
        "amx",
        "vLLM runs int8 W8A8 experts on x86 CPUs with AMX only (CPUExpertsInt8; without, its load fails: 'No Int8 "
        "MoE backend supports the deployment configuration')",
        intermediate_multiple=32,
    ),
    ExpertsLimitation(
        "W4A16",
        _int4_weight_only,
        "amx",
        "vLLM runs 4-bit weight-only experts on x86 CPUs with AMX only (CPUExpertsInt4; without, its load fails: "
        "'No WNA16 MoE backend supports the deployment configuration')",
        stand_in="int4 experts with int8 activations (CPUExpertsInt4, W4A8)",
    ),
    ExpertsLimitation(
        "int8 W8A16",
        lambda s: s.weight_type == "int" and s.weight_bits == 8 and not s.activations,
        "never",
        "vLLM's CPU weight-only experts take 4-bit weights only (CPUExpertsInt4: kInt4Static)",
    ),
    ExpertsLimitation(
        "NVFP4",
        lambda s: s.weight_type == "float" and s.weight_bits == 4 and s.group_size == 16,
        "never",
        "vLLM's NVFP4 experts are CUDA kernels and a Triton emulation (fused_moe/oracle/nvfp4.py): none runs on a CPU",
    ),
    ExpertsLimitation(
        "MXFP4",
        lambda s: s.weight_type == "float" and s.weight_bits == 4 and s.group_size != 16,
        "amx",
        "vLLM runs MXFP4 experts on CPU with AMX only (CPUExpertsMxfp4, weight-only: bf16 activations)",
    ),
)


# The activation dtype vLLM computes a bundle in: float32, as transformers evaluates every bundle (the two
# runtimes then differ by their kernels, not by their arithmetic), except where vLLM's CPU kernel takes no
# float32: its 4-bit weight-only GEMM (seen here: `"cpu_gemm_wna16" not implemented for 'Float'`), with
# AMX in use its int8 W8A8 GEMM (`int8_scaled_mm_with_quant: expect A to be bfloat16 or half`), and its
# block FP8 GEMM, AMX only (`fp8_scaled_mm_cpu: expect A to be bfloat16 or half`).
# (name, which schemes, dtype, only where AMX is used)
DEFAULT_DTYPE = "float32"
COMPUTE_DTYPES: tuple[tuple[str, Callable[[WeightScheme], bool], str, bool], ...] = (
    ("W4A16", _int4_weight_only, "bfloat16", False),
    ("int8 W8A8 with AMX", int8_w8a8, "bfloat16", True),
    ("block FP8", _fp8_block, "bfloat16", False),
)


# What vLLM's CUDA build runs on a GPU of compute capability `sm` (major × 10 + minor), read at the source
# of the pinned vllm 0.32.0 (the same Python in its CPU build): model_executor/layers/quantization/
# compressed_tensors/compressed_tensors.py `_get_scheme_from_parts` and each scheme's `get_min_capability`,
# utils/marlin_utils_fp8.py and marlin_utils_fp4.py (Marlin from sm75), utils/nvfp4_utils.py
# (`cutlass_fp4_supported`: sm100+), kernels/linear/mxfp4/flashinfer.py (sm100+), and
# v1/attention/backends/triton_attn.py (an FP8 KV cache needs SM89's fp8e4nv).
# kiln loads every bundle with bfloat16 activations, which need sm80 (Ampere): that is the floor.
BF16_MIN_SM = 80


@dataclass(frozen=True)
class CudaKernels:
    """How vLLM's CUDA build runs a scheme: with its own arithmetic from `native_sm`, and below that, from
    `loads_sm`, through a `fallback` kernel that computes something else (weight-only: activations stay
    bfloat16), which the eval then measures and names in its runtime version (`fallback`: a short label in
    the registry's runtime-version characters); below `loads_sm` it cannot run at all."""

    scheme: str
    matches: Callable[[WeightScheme], bool]
    native_sm: int
    loads_sm: int
    fallback: str = ""


def _fp4(s: WeightScheme) -> bool:
    return s.weight_type == "float" and s.weight_bits == 4


CUDA_KERNELS: tuple[CudaKernels, ...] = (
    CudaKernels(
        "NVFP4 W4A4",
        lambda s: _fp4(s) and s.group_size == 16 and s.activations,
        native_sm=100,
        loads_sm=75,
        fallback="NVFP4 weight-only (Marlin FP4 W4A16, below sm100)",
    ),
    CudaKernels("NVFP4 W4A16", lambda s: _fp4(s) and s.group_size == 16 and not s.activations, 75, 75),
    CudaKernels(
        "MXFP4",
        lambda s: _fp4(s) and s.group_size != 16,
        native_sm=100,
        loads_sm=80,
        fallback="MXFP4 weight-only (Marlin FP4 W4A16, below sm100)",
    ),
    CudaKernels(
        "FP8 W8A8",
        lambda s: s.weight_type == "float" and s.weight_bits == 8 and s.activations,
        native_sm=89,
        loads_sm=75,
        fallback="FP8 weight-only (Marlin W8A16, below sm89)",
    ),
    CudaKernels("FP8 W8A16", lambda s: s.weight_type == "float" and s.weight_bits == 8 and not s.activations, 75, 75),
    CudaKernels("int8 W8A8", int8_w8a8, 75, 75),
    CudaKernels("int W4A16/W8A16", lambda s: s.weight_type == "int" and not s.activations, 75, 75),
)
FP8_KV_CACHE_MIN_SM = 89


@dataclass(frozen=True)
class CudaVerdict:
    """A bundle on a GPU: why vLLM cannot run it there (`cannot`), or what it runs instead of the bundle's
    own arithmetic (`fallbacks`, said in the eval's runtime version)."""

    cannot: str | None
    fallbacks: tuple[str, ...] = ()


def cuda_verdict(schemes: Sequence[WeightScheme], sm: int, fp8_kv_cache: bool = False) -> CudaVerdict:
    """What vLLM's CUDA build does with a bundle of `schemes` (and an FP8 KV cache) on a GPU of compute
    capability `sm` (`CUDA_KERNELS`); the smallest capability of the GPUs a tensor-parallel replica spans."""
    name = f"sm{sm}"
    if sm < BF16_MIN_SM:
        return CudaVerdict(f"kiln evaluates with bfloat16 activations, which need sm{BF16_MIN_SM}; this GPU is {name}")
    if fp8_kv_cache and sm < FP8_KV_CACHE_MIN_SM:
        return CudaVerdict(
            f"FP8 KV cache: vLLM's attention keeps an FP8 cache from sm{FP8_KV_CACHE_MIN_SM} (fp8e4nv); "
            f"this GPU is {name}"
        )
    fallbacks: list[str] = []
    for kernels in CUDA_KERNELS:
        if not any(kernels.matches(s) for s in schemes):
            continue
        if sm < kernels.loads_sm:
            return CudaVerdict(f"{kernels.scheme}: vLLM runs it from sm{kernels.loads_sm}; this GPU is {name}")
        if sm < kernels.native_sm and kernels.fallback not in fallbacks:
            fallbacks.append(kernels.fallback)
    return CudaVerdict(None, tuple(fallbacks))


# Families whose vLLM model (vllm 0.32.0 model_executor/models/qwen2.py `Qwen2Model`, which Qwen3 builds on) asserts
# that every layer slides or none does ("Sliding window for some but all layers is not supported"), seen as its
# load error here; Gemma 3's sliding and global layers are served (tests/placement/test_vllm_kv.py).
ONE_LAYER_TYPE_FAMILIES = ("qwen2", "qwen3")


def architecture_limitation(config: dict[str, Any], records: dict[str, Architecture] = ARCHITECTURES) -> str | None:
    """Why vLLM cannot serve a bundle of this config.json: its family record refuses the `vllm` runtime (the
    record's reason), its stacked experts stayed bf16 in a quantized bundle, or its layers mix sliding and full
    attention in a family whose vLLM model takes one kind.
    None where it can, and where kiln has no record of the architecture or cannot read the config (vLLM's own
    load then decides)."""
    listed = config.get("architectures")
    name = listed[0] if isinstance(listed, list) and len(listed) == 1 and isinstance(listed[0], str) else None
    record = records.get(name) if name is not None else None
    if record is None:
        return None
    mapping = record.target("vllm")
    if mapping.refused is not None:
        return f"{record.hf_class} ({record.family}): {mapping.refused}"
    experts, quant = record.mlp.experts, config.get("quantization_config")
    compressed = isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors"
    if experts is not None and experts.layout == "fused" and compressed:
        # kiln's schemes quantize no stacked experts (gpt-oss's stay bf16 beside the quantized Linears); vLLM 0.32's
        # GptOssForCausalLM, given a compressed-tensors config, builds its experts without their biases (measured:
        # its load fails with KeyError 'layers.0.mlp.experts.w2_bias'). Given the release's own `quant_method:
        # mxfp4` it loads them as released (`GptOssModel._load_weights_mxfp4`): the experts' limits then decide.
        return (
            f"{record.hf_class}: its stacked experts stay bf16 beside quantized Linears, and vLLM's model of the "
            "family, given the bundle's quantization_config, builds them without their biases (its load fails: "
            "KeyError 'layers.0.mlp.experts.w2_bias')"
        )
    if record.family in ONE_LAYER_TYPE_FAMILIES:
        try:
            kinds = set(ModelShape.from_config(config).layer_types)
        except KilnError:
            return None
        if len(kinds) > 1:
            return (
                f"{record.hf_class}: vLLM's {record.family} model slides every layer or none, and this config slides "
                "some (use_sliding_window with max_window_layers below num_hidden_layers)"
            )
    return None


def compute_dtype(schemes: Sequence[WeightScheme], amx: bool = False) -> str:
    """The activation dtype vLLM evaluates a bundle of `schemes` in (`COMPUTE_DTYPES`, else float32);
    `amx`: whether the worker lets vLLM use its AMX kernels."""
    for _, matches, dtype, needs_amx in COMPUTE_DTYPES:
        if (amx or not needs_amx) and any(matches(s) for s in schemes):
            return dtype
    return DEFAULT_DTYPE


def bundle_config(bundle_dir: Path) -> dict[str, Any]:
    """A bundle's config.json, as an object; anything else is a clear error, not a crash later."""
    try:
        config = json.loads((bundle_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(
            f"{bundle_dir}: no readable config.json ({e})",
            code=Codes.BUNDLE_CONFIG_INVALID,
            details={"path": str(bundle_dir)},
        ) from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{bundle_dir}: config.json is not an object", code=Codes.BUNDLE_CONFIG_INVALID)
    return config


# A release's own layout, by its quant_method: the schemes of its Linear layers and of its experts. gpt-oss's MXFP4
# (the catalog's mxfp4-experts) quantizes its experts alone, weight-only, in groups of 32 (vLLM's
# `GptOssMxfp4MoEMethod`: kMxfp4Static weights, bf16 activations).
_MXFP4_EXPERTS = WeightScheme(
    weight_type="float", weight_bits=4, weight_strategy="group", activations=False, group_size=32
)
RELEASE_SCHEMES: dict[str, tuple[tuple[WeightScheme, ...], tuple[WeightScheme, ...]]] = {
    "mxfp4": ((), (_MXFP4_EXPERTS,)),
}


def _release(config: dict[str, Any]) -> tuple[tuple[WeightScheme, ...], tuple[WeightScheme, ...]] | None:
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return RELEASE_SCHEMES.get(method) if isinstance(method, str) else None


def bundle_expert_schemes(config: dict[str, Any]) -> list[WeightScheme]:
    """The weight schemes of a bundle's routed experts: a release layout's own (`RELEASE_SCHEMES`), else its Linear
    layers' (kiln quantizes every expert as the Linears)."""
    release = _release(config)
    return list(release[1]) if release is not None else bundle_schemes(config)


def bundle_schemes(config: dict[str, Any]) -> list[WeightScheme]:
    """The weight schemes of a bundle's Linear layers: a compressed-tensors bundle's config groups, a release layout's
    own (`RELEASE_SCHEMES`); [] for an unquantized one."""
    release = _release(config)
    if release is not None:
        return list(release[0])
    quant = config.get("quantization_config") or {}
    groups = quant.get("config_groups") if isinstance(quant, dict) else None
    if quant and not isinstance(groups, dict):
        raise InvalidInput("`quantization_config` has no `config_groups` object", code=Codes.BUNDLE_CONFIG_INVALID)
    return [WeightScheme.from_group(g) for g in (groups or {}).values()]


# config.json's expert counts, for an architecture kiln has no record of (Qwen2-MoE and Qwen3-MoE, Mixtral,
# DeepSeek's routed experts).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def bundle_experts(config: dict[str, Any]) -> ExpertsShape | None:
    """A bundle's routed experts (None: its model has none): config.json read through the family record (the
    layers its config makes sparse, `ModelShape.moe`). For an architecture kiln has no record of, or a config it
    cannot read, a positive expert count in config.json (`EXPERT_COUNT_KEYS`) says there are experts, of
    `moe_intermediate_size` (else `intermediate_size`)."""
    try:
        shape = ModelShape.from_config(config)
    except KilnError:
        shape = None
    if shape is not None:
        moe = shape.moe
        if moe is None or not moe.sparse_layers:
            return None
        return ExpertsShape(shape.hidden_size, moe.intermediate_size)
    counts = [config.get(k) for k in EXPERT_COUNT_KEYS]
    if not any(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        return None
    hidden = config.get("hidden_size")
    inner = config.get("moe_intermediate_size") or config.get("intermediate_size")
    if not isinstance(hidden, int) or not isinstance(inner, int):
        return None  # vLLM's own load decides
    return ExpertsShape(hidden, inner)


def fp8_kv_cache(config: dict[str, Any]) -> bool:
    """Whether a bundle's config asks for a quantized (FP8) KV cache: its `kv_cache_scheme`."""
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and bool(quant.get("kv_cache_scheme"))


def head_size(config: dict[str, Any]) -> int | None:
    """The model's attention head size from its config (None where it does not say it as integers)."""
    head, hidden, heads = config.get("head_dim"), config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(head, int) and head > 0:
        return head
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


# vllm 0.32.0 v1/attention/backends/mla/cpu_mla.py `CPUMLABackend.get_supported_head_sizes`: the CPU MLA decode
# kernel (csrc/cpu/mla_decode.cpp) takes DeepSeek's latent only, kv_lora_rank 512 + qk_rope_head_dim 64.
CPU_MLA_LATENT = 576


def mla_cpu_limitation(config: dict[str, Any]) -> str | None:
    """Why vLLM's CPU build cannot evaluate a bundle of this config.json with multi-head latent attention, or None
    (None too where it has no MLA, or kiln cannot read the config: vLLM's own load then decides). Two limits: the
    latent its CPU kernel takes (`CPU_MLA_LATENT`), and a rope without scaling, which vLLM 0.32's CPU build computes
    unlike transformers (measured on a tiny DeepSeek-V3 of DeepSeek's latent: mean KL 2.2 against transformers'
    float32 logits with the queries made sharp, 6e-10 with the rope half of every query zeroed, 9e-9 with YaRN as
    DeepSeek's releases set it), so kiln does not score it there."""
    try:
        shape = ModelShape.from_config(config)
    except KilnError:
        return None
    if shape.mla is None:
        return None
    latent = shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim
    if latent != CPU_MLA_LATENT:
        return (
            f"MLA: vLLM's CPU MLA kernel takes a latent of {CPU_MLA_LATENT} (kv_lora_rank 512 + qk_rope_head_dim 64, "
            f"DeepSeek's); this model's is {latent} ({shape.mla.kv_lora_rank} + {shape.mla.qk_rope_head_dim})"
        )
    if all(spec.scaling == "default" for _, spec in shape.rope):
        return (
            "MLA with an unscaled rope: vLLM 0.32's CPU build rotates it unlike transformers (measured: mean KL 2.2 "
            "on a tiny DeepSeek-V3 whose attention follows the rope; 9e-9 with YaRN, as DeepSeek's releases set it)"
        )
    return None


def cpu_limitation(
    schemes: Sequence[WeightScheme],
    capabilities: VllmCapabilities,
    hello: dict[str, Any],
    head: int | None = None,
    fp8_kv_cache: bool = False,
    experts: ExpertsShape | None = None,
    expert_schemes: Sequence[WeightScheme] | None = None,
) -> str | None:
    """Why vLLM cannot run a bundle of `schemes` with attention heads of `head` (and an FP8 KV cache, and routed
    `experts`) here (given this machine's `capabilities` and the worker's `hello`), or None if it can. A mixture's
    experts are quantized as `expert_schemes` (None: as its Linear layers, kiln quantizing every expert; a release
    layout's own: `bundle_expert_schemes`): the experts' limits (`CPU_EXPERTS_LIMITS`) apply to them after the Linear
    layers' (`CPU_LIMITS`), which vLLM meets first as it builds the model."""
    sizes = hello.get("head_sizes")
    if head is not None and sizes and head not in sizes:
        return f"vLLM's CPU attention takes head sizes {', '.join(map(str, sizes))}; this model's is {head}"
    if fp8_kv_cache and "avx512f" not in capabilities.cpu_flags:
        # vllm 0.32.0 v1/attention/backends/cpu_attn.py: an fp8 cache only on x86 with AVX-512 (or AMX).
        return "FP8 KV cache: vLLM's CPU attention keeps an FP8 cache only with AVX-512; this CPU has none"
    for limit in CPU_LIMITS:
        if not any(limit.matches(s) for s in schemes):
            continue
        if limit.needs == "never":
            return f"{limit.scheme}: {limit.reason}"
        if limit.needs == "amx" and not capabilities.amx.used:
            return f"{limit.scheme}: {limit.reason}; AMX here: {capabilities.amx.reason}"
        if limit.needs == "fp8_matmul" and not capabilities.fp8_matmul.usable:
            return f"{limit.scheme}: {limit.reason} ({capabilities.fp8_matmul.reason})"
        if limit.needs == "int8_exact" and not capabilities.int8_matmul.exact:
            return f"{limit.scheme}: {limit.reason}"
        kernel = limit.needs.removeprefix("kernel:")
        if limit.needs.startswith("kernel:") and not hello["kernels"].get(kernel, False):
            return f"{limit.scheme}: {limit.reason}"
    if experts is None:
        return None
    return experts_limitation(schemes if expert_schemes is None else expert_schemes, capabilities, experts)


def experts_limitation(
    schemes: Sequence[WeightScheme], capabilities: VllmCapabilities, experts: ExpertsShape
) -> str | None:
    """Why vLLM's CPU build cannot run a mixture's `experts` quantized as `schemes` here (`CPU_EXPERTS_LIMITS`,
    `EXPERTS_HIDDEN_MULTIPLE`), or None if it can."""
    if experts.hidden_size % EXPERTS_HIDDEN_MULTIPLE:
        return (
            f"experts: vLLM's CPU experts kernels take hidden sizes in multiples of {EXPERTS_HIDDEN_MULTIPLE}; "
            f"this model's is {experts.hidden_size}"
        )
    for limit in CPU_EXPERTS_LIMITS:
        if not any(limit.matches(s) for s in schemes):
            continue
        if limit.needs == "never":
            return f"{limit.scheme} experts: {limit.reason}"
        if limit.needs == "amx" and not capabilities.amx.used:
            return f"{limit.scheme} experts: {limit.reason}; AMX here: {capabilities.amx.reason}"
        if experts.intermediate_size % limit.intermediate_multiple:
            return (
                f"{limit.scheme} experts: vLLM's CPU kernel takes intermediate sizes in multiples of "
                f"{limit.intermediate_multiple}; this model's experts' is {experts.intermediate_size}"
            )
    return None


def experts_stand_ins(schemes: Sequence[WeightScheme], hello: dict[str, Any]) -> tuple[str, ...]:
    """What vLLM's CPU build computes a mixture's experts of `schemes` with instead of the bundle's own arithmetic
    (`ExpertsLimitation.stand_in`, unless the worker's `hello` reports the capability that avoids it)."""
    return tuple(
        limit.stand_in
        for limit in CPU_EXPERTS_LIMITS
        if limit.stand_in and not (limit.unless and hello.get(limit.unless)) and any(limit.matches(s) for s in schemes)
    )
