"""Fit and speed of one replica: how many devices of a hardware profile an artifact needs, and its bounds.

Pure functions over a model's shape (`core.shape.ShapeRecord`, read from an untrusted config), an artifact's
weight bytes and quant, and a `core.hardware.HardwareProfile`; no I/O. `plan_replica` picks the
smallest tensor-parallel degree whose share of the weights and KV cache fits in each device's usable
memory, and bounds what that replica can do. The KV cache is counted as vLLM pages it on that device
(`placement.model.PagedKvCache` with `vllm_defaults`: pages of 16 tokens, 128 on a CPU; a sliding layer keeps its
window and the tokens of the steps in flight), so a fit here is one vLLM admits.

- decode is a roofline: each step reads, on every device, its share of the weights (of a mixture of experts,
  the share its tokens' experts touch: `placement.model.active_parameters`) and of the KV cache its attention
  reads at full context (every token of a full layer, a sliding layer's window: `kv_cache_bytes`; those bytes ÷
  (bandwidth × efficiency)), and computes 2 × active parameters × `concurrency`
  FLOPs of matmuls at the artifact's matmul type on all TP devices × efficiency; the step takes the longer
  of the two. Few sequences are bandwidth-bound (the smallest weights win); many are FLOP-bound, where
  what the hardware computes natively (FP4 on Blackwell and gfx950, FP8 on Hopper) wins. The replica
  makes `concurrency` tokens a step, each sequence one.
- prefill is FLOP-bound: one prompt of `context` tokens costs 2 × parameters × context for the
  matmuls plus 2 × layers × heads × head_dim × context² for attention, at the matmul type the
  artifact computes in (`matmul_dtype`) on all TP devices × efficiency.

efficiency is 1 on one device and the interconnect's `tp_efficiency` under TP (the all-reduces).

Each data-sheet peak is scaled by the share of it measured on that SKU where its catalog entry has a
`measured` record (`core.hardware.MeasuredEfficiency`, from `kiln hardware probe`), and the plan says which
(`basis`, a `core.resolve.BoundBasis`):

- the weights are read at the share a decode-like chain reached with weights of their matmul path
  (`weight_path`: bf16, or FP8 / INT8 / FP4 read by the matmul that runs in that type); a path with no such
  measurement (weights dequantized before a bf16 matmul: W4A16, GGUF types; or an unmeasured type) at the
  plain memory-read share, labelled so. The KV cache is read by attention, not a matmul: at the memory-read
  share.
- matmuls (prefill, and decode when FLOP-bound) run at the large-M share of the type they run in
  (`matmul_dtype_on`); a type with no measured share at its peak.
- usable memory is `MEMORY_UTILIZATION` of the smaller of the memory and the measured allocatable memory.

Without a record every bound rests on the peaks ("spec"): upper bounds for ranking and sizing that a real
server reaches a share of. A measured performance record of the artifact (`registry.resolve.ranking`) is
used before any bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.hardware import (
    BANDWIDTH_GBS,
    DEVICES_PER_NODE,
    FRACTION,
    MEMORY_GIB,
    PRICE_PER_DEVICE_HOUR,
    TFLOPS,
    TP_EFFICIENCY,
    HardwareProfile,
    MatmulDtype,
)
from kiln.core.resolve import BoundBasis
from kiln.core.shape import MAX_DIMENSION, ShapeRecord, kv_element_bytes
from kiln.placement.model import (
    PagedKvCache,
    active_parameters,
    flops_parameters,
    kv_cache_bytes,
    kv_elements_per_token_layer,
    paged_kv_cache,
    parameters,
    sliding_layer_count,
    tp_degrees,
    vllm_defaults,
)
from kiln.quant.catalog import METHODS

GIB = 1024**3

# The share of each device a server gives to weights and KV cache; the other 10 % is kept for
# activations, CUDA graphs and the allocator (vLLM's default gpu_memory_utilization).
MEMORY_UTILIZATION = 0.90

# Bounds on what a caller asks (context, concurrency: MAX_DIMENSION), far past any real replica, so the
# arithmetic stays within floats.
MAX_WEIGHTS_BYTES = 2**60


def matmul_dtype(quant: str) -> MatmulDtype:
    """The input type of an artifact's matmuls: fp4 for FP4 W4A4, fp8 for FP8 W8A8, int8 for int8 W8A8, else
    bf16. Weight-only schemes (W8A16, W4A16, GGUF types) dequantize to bf16 before each matmul."""
    method = METHODS.get(quant)
    return method.matmul_dtype if method is not None else "bf16"


def kv_dtype_of(quant: str, asked: str, profile: HardwareProfile) -> str:
    """The KV cache a replica of the artifact keeps on `profile`: FP8 where its checkpoint carries calibrated FP8
    KV scales and the device has FP8 (vLLM then keeps the cache in FP8 whatever the caller assumed), else what
    the caller asked for."""
    method = METHODS.get(quant)
    fp8_kv = method is not None and method.kv_cache_dtype == "fp8" and profile.fp8 is not None
    return "fp8" if fp8_kv else asked


def matmul_dtype_on(quant: str, profile: HardwareProfile) -> MatmulDtype:
    """What an artifact's matmuls run in on `profile`: bf16 where it lacks the units (fp8, int8, or the
    method's own FP4 block format)."""
    method = METHODS.get(quant)
    return method.matmul_dtype_on(profile) if method is not None else "bf16"


def weight_path(quant: str, profile: HardwareProfile) -> MatmulDtype | None:
    """The matmul an artifact's weights are read through in decode on `profile`: bf16 for unquantized weights,
    fp8 / int8 / fp4 where its matmuls run natively in that type there; None where the weights are dequantized
    before a bf16 matmul (weight-only schemes, GGUF types, a low type the device lacks the units for)."""
    method = METHODS.get(quant)
    if method is None:
        return None
    if method.weight_dtype == "bfloat16":
        return "bf16"
    dtype = method.matmul_dtype_on(profile)
    return dtype if dtype != "bf16" else None


@dataclass(frozen=True)
class Shares:
    """The shares of a profile's peaks a plan uses: 1 and "spec" for each one its entry has no measurement of."""

    weights: float = 1.0
    weights_from: Literal["decode", "memory_read", "spec"] = "spec"
    kv: float = 1.0
    matmul: float = 1.0
    matmul_from: Literal["measured", "spec"] = "spec"
    allocatable_bytes: int | None = None
    source: str | None = None


def shares(profile: HardwareProfile, path: MatmulDtype | None, matmul: MatmulDtype) -> Shares:
    """The measured shares of `profile`'s peaks for weights read through `path` (`weight_path`) and matmuls in
    `matmul`: a decode chain's for the path where measured, else the plain memory read's; the KV cache at the
    memory read's; the large-M matmul share of `matmul` where measured, else 1 (spec)."""
    m = profile.measured
    if m is None:
        return Shares()

    def checked(name: str, value: float) -> float:
        return _check_rate(profile, f"measured.{name}", value, FRACTION)

    read = checked("memory_read", m.memory_read)
    decode = getattr(m.decode, path) if path is not None else None
    rate = getattr(m.matmul, matmul)
    allocatable = m.allocatable_gib
    return Shares(
        weights=checked(f"decode.{path}", decode) if decode is not None else read,
        weights_from="decode" if decode is not None else "memory_read",
        kv=read,
        matmul=checked(f"matmul.{matmul}", rate) if rate is not None else 1.0,
        matmul_from="measured" if rate is not None else "spec",
        allocatable_bytes=(
            int(_check_rate(profile, "measured.allocatable_gib", allocatable, MEMORY_GIB) * GIB)
            if allocatable is not None
            else None
        ),
        source=f"{m.source}, {m.measured_on}",
    )


def _rate(value: float) -> str:
    return f"{value:,g}"


def _basis_text(share: Shares, path: MatmulDtype | None, bandwidth_gbs: float, tflops: float, used: str) -> str:
    """Which rates the bounds used, measured shares or data-sheet peaks, in a line."""
    if share.source is None:
        return f"bounds at data-sheet peaks (spec): {_rate(bandwidth_gbs)} GB/s, {_rate(tflops)} TFLOP/s {used}"
    read = f"{path} decode" if share.weights_from == "decode" else "memory read"
    parts = [f"decode at {share.weights:.2f} × {_rate(bandwidth_gbs)} GB/s ({read}, measured)"]
    if share.weights_from == "decode":
        parts.append(f"KV cache at {share.kv:.2f} × (memory read, measured)")
    if share.matmul_from == "measured":
        parts.append(f"prefill at {share.matmul:.2f} × {_rate(tflops)} TFLOP/s {used} (measured)")
    else:
        parts.append(f"prefill at {_rate(tflops)} TFLOP/s {used} (spec: not measured)")
    return ", ".join(parts)


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica of an artifact on a hardware profile: its tensor-parallel degree, memory and bounds."""

    hardware: str
    quant: str
    context: int
    concurrency: int
    kv_dtype: str
    fits: bool
    tp: int  # chosen; when nothing fits, the largest tried
    devices: int  # = tp
    max_tp: int  # min(devices_per_node, max_devices)
    memory_per_device_bytes: int
    usable_per_device_bytes: int  # MEMORY_UTILIZATION of it
    weights_bytes: int
    weights_per_device_bytes: int
    kv_cache_bytes: int  # the replica's, paged as vLLM pages it (0 when the shape is unknown)
    kv_per_device_bytes: int  # with KV heads replicated where tp > kv_heads
    kv_room_per_device_bytes: int  # usable - weights per device: left for KV (negative: the weights alone do not fit)
    required_per_device_bytes: int  # weights + KV per device
    decode_tokens_per_s: float  # whole replica, `concurrency` sequences
    decode_tokens_per_s_per_sequence: float
    prefill_tokens_per_s: float | None
    ttft_s: float | None  # one prompt of `context` tokens; None when parameters are unknown
    matmul_dtype: MatmulDtype  # the type the matmuls run in on this hardware
    matmul_tflops: float
    cost_per_mtok: float | None  # USD per million output tokens at the decode bound; None without a price
    basis: BoundBasis  # which bounds rest on measured shares of the peaks, and which on spec
    explanation: str


def _check_count(name: str, value: Any, minimum: int, maximum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise InvalidInput(
            f"{name} must be an integer from {minimum} to {maximum}; got {str(value)[:32]}",
            code=Codes.REPLICA_INPUT_INVALID,
            details={"field": name, "minimum": minimum, "maximum": maximum},
        )
    return value


def _check_rate(
    profile: HardwareProfile, name: str, value: Any, bounds: tuple[float, float], *, above: bool = False
) -> float:
    """A fact of `profile` that resolve divides by or multiplies with, inside the catalog's range.

    Validated profiles always are; one built around validation (or an entry from an older kiln) is
    refused here with the catalog's code, so no division blows up and every bound stays finite."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (bounds[0] < value if above else bounds[0] <= value) or not value <= bounds[1]:
        low = "above " if above else ""
        raise InvalidInput(
            f"hardware {profile.name!r}: {name} {str(value)[:32]} is outside {low}{bounds[0]:g} to {bounds[1]:g}",
            code=Codes.HARDWARE_CATALOG_INVALID,
            details={"hardware": profile.name, "field": name, "minimum": bounds[0], "maximum": bounds[1]},
        )
    return float(value)


def _read_share(shape: ShapeRecord | str, concurrency: int) -> float:
    """The share of the weights a decode step of `concurrency` sequences reads: 1 for a dense model (or an
    unknown shape), active / total parameters for a mixture of experts."""
    if not isinstance(shape, ShapeRecord) or not shape.is_moe:
        return 1.0
    total, active = parameters(shape), active_parameters(shape, concurrency)
    return min(active / total, 1.0) if total and active is not None else 1.0


def _gib(n: float) -> str:
    """GiB to one decimal, or MiB below a tenth of a GiB (a small model's weights are not "0.0 GiB")."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def plan_replica(
    profile: HardwareProfile,
    shape: ShapeRecord | str,
    weights_bytes: int,
    quant: str,
    context: int,
    concurrency: int,
    kv_dtype: str = "bf16",
    max_devices: int | None = None,
) -> ReplicaPlan:
    """The smallest tensor-parallel replica of an artifact (`weights_bytes`, `quant`) on `profile` that
    holds the weights and a KV cache of `context` × `concurrency` tokens, with its decode, prefill and
    cost bounds. `shape` is `ShapeRecord.from_untrusted(config)`; a sentence there (the shape is unknown) counts no
    KV cache and leaves TTFT unknown. TP degrees are powers of two up to min(devices_per_node,
    max_devices) that split the attention heads and the KV heads (or replicate the KV heads evenly)."""
    context = _check_count("context", context, 1, MAX_DIMENSION)
    concurrency = _check_count("concurrency", concurrency, 1, MAX_DIMENSION)
    weights_bytes = _check_count("weights_bytes", weights_bytes, 0, MAX_WEIGHTS_BYTES)
    if max_devices is not None:
        _check_count("max_devices", max_devices, 1, MAX_DIMENSION)
    kv_element_bytes(kv_dtype)  # an unknown KV dtype is refused before anything is sized
    memory_gib = _check_rate(profile, "memory_gib", profile.memory_gib, MEMORY_GIB)
    bandwidth_gbs = _check_rate(profile, "bandwidth_gbs", profile.bandwidth_gbs, BANDWIDTH_GBS)
    devices_per_node = int(_check_rate(profile, "devices_per_node", profile.devices_per_node, DEVICES_PER_NODE))
    limit = min(devices_per_node, max_devices or devices_per_node)
    allowed, excluded = tp_degrees(shape if isinstance(shape, ShapeRecord) else None, limit)
    memory = int(memory_gib * GIB)
    tflops, used = profile.matmul_tflops(matmul_dtype_on(quant, profile))
    tflops = _check_rate(profile, f"tflops.{used}", tflops, TFLOPS)
    path = weight_path(quant, profile)
    share = shares(profile, path, used)
    allocatable = share.allocatable_bytes
    held = min(memory, allocatable) if allocatable is not None else memory  # what a server can take
    usable = round(MEMORY_UTILIZATION * held)
    serving = vllm_defaults(
        profile.family, memory_gib, profile.name, mla=isinstance(shape, ShapeRecord) and shape.is_mla
    )

    def paged(tp: int) -> PagedKvCache | None:
        if not isinstance(shape, ShapeRecord):
            return None
        return paged_kv_cache(
            shape,
            block_size=serving.block_size,
            in_flight_tokens=serving.in_flight_tokens,
            kv_dtype=kv_dtype,
            tp=tp,  # tp > kv_heads: one KV head each
        )

    whole = paged(1)
    kv_total = whole.bytes(context, concurrency) if whole is not None else 0

    def per_device(tp: int) -> tuple[int, int]:
        cache = paged(tp)
        return -(-weights_bytes // tp), cache.bytes(context, concurrency) if cache is not None else 0

    tried: list[tuple[int, int]] = []  # (tp, weights + KV per device) of each TP that did not fit
    tp = allowed[-1]
    for candidate in allowed:
        w, kv = per_device(candidate)
        if w + kv <= usable:
            tp = candidate
            break
        tried.append((candidate, w + kv))
    w_dev, kv_dev = per_device(tp)
    fits = w_dev + kv_dev <= usable

    efficiency = 1.0
    if tp > 1 and profile.interconnect is not None:
        efficiency = profile.interconnect.tp_efficiency
        efficiency = _check_rate(profile, "interconnect.tp_efficiency", efficiency, TP_EFFICIENCY, above=True)
    # Every divisor below is a product of bounded, positive facts, and every dividend is bounded by
    # MAX_WEIGHTS_BYTES and MAX_DIMENSION: the bounds stay finite floats and above zero.
    params = flops_parameters(shape) if isinstance(shape, ShapeRecord) else None
    # A mixture of experts reads, per step, the share of its weights the step's tokens touch (`active_parameters`).
    read_w = w_dev * _read_share(shape, concurrency)
    # Attention reads each sequence's tokens, a sliding layer's window of them, not the pages held for admission.
    kv_read = kv_cache_bytes(shape, context, concurrency, kv_dtype, tp) if isinstance(shape, ShapeRecord) else 0
    read_bytes = max(read_w / share.weights + kv_read / share.kv, 1)  # bytes at the data sheet's rate
    memory_s = read_bytes / (bandwidth_gbs * 1e9 * efficiency)
    flops_per_s = tp * tflops * 1e12 * share.matmul * efficiency
    compute_s = 2 * params * concurrency / flops_per_s if params is not None else 0.0
    step_s = max(memory_s, compute_s)
    decode = concurrency / step_s
    ttft: float | None = None
    if isinstance(shape, ShapeRecord) and params is not None and shape.num_attention_heads is not None:
        flops = 2 * params * context + 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * context**2
        ttft = flops / flops_per_s
    price = profile.price_per_device_hour
    if price is not None:
        price = _check_rate(profile, "price_per_device_hour", price, PRICE_PER_DEVICE_HOUR)
    cost = price * tp / (decode * 3600) * 1e6 if price is not None else None

    link = f" ({profile.interconnect.name})" if tp > 1 and profile.interconnect is not None else ""
    arithmetic = f"{_gib(w_dev)} weights + {_gib(kv_dev)} KV per device"
    room = f"{_gib(usable)} usable of {_gib(memory)}"
    if held < memory:
        room = f"{_gib(usable)} usable of {_gib(held)} allocatable (measured, of {_gib(memory)})"
    if fits:
        parts = [f"TP {tp} of {limit}{link}: {arithmetic} ≤ {room}"]
        if tried:
            parts.append(", ".join(f"TP {t} needs {_gib(need)}" for t, need in tried))
    else:
        parts = [f"does not fit in {limit} device{'s' if limit > 1 else ''}: TP {tp}{link} needs {arithmetic} > {room}"]
    if excluded and isinstance(shape, ShapeRecord):
        heads = f"{shape.num_attention_heads} heads, " if shape.num_attention_heads is not None else ""
        parts.append(f"TP {', '.join(map(str, excluded))} not tried ({heads}{shape.num_kv_heads} KV heads)")
    window = shape.sliding_window if isinstance(shape, ShapeRecord) else None
    if isinstance(shape, ShapeRecord) and window is not None and window - 1 + serving.in_flight_tokens < context:
        parts.append(
            f"{sliding_layer_count(shape)} of {shape.num_layers} layers slide: each sequence keeps "
            f"{window - 1 + serving.in_flight_tokens} of its {context} tokens there (a {window}-token window, "
            f"{serving.in_flight_tokens} in flight)"
        )
    if isinstance(shape, ShapeRecord) and shape.is_mla:
        parts.append(
            f"MLA: {kv_elements_per_token_layer(shape)} cache elements a token and layer (a latent and a rope key), "
            "whole on every device"
        )
    elif isinstance(shape, ShapeRecord) and tp > shape.num_kv_heads:
        parts.append(f"KV heads replicated: {shape.num_kv_heads} over TP {tp}, one per device")
    if isinstance(shape, ShapeRecord) and shape.is_moe and read_w < w_dev:
        parts.append(
            f"experts: a decode step of {concurrency} reads {read_w / w_dev:.0%} of the weights "
            f"({shape.experts_per_token} of {shape.num_experts} experts per token)"
        )
    if compute_s > memory_s:
        rate = f"{share.matmul:.2f} × {tflops:g}" if share.matmul_from == "measured" else f"{tflops:g}"
        parts.append(f"decode FLOP-bound at {concurrency} sequences ({used} matmuls, {rate} TFLOP/s per device)")
    parts.append(_basis_text(share, path, bandwidth_gbs, tflops, used))
    if isinstance(shape, str):
        parts.append(shape)
    basis = BoundBasis(
        decode=share.matmul_from if compute_s > memory_s else ("spec" if share.weights_from == "spec" else "measured"),
        prefill=share.matmul_from,
        memory="measured" if held < memory else "spec",
        bandwidth_fraction=share.weights,
        bandwidth_path=share.weights_from,
        kv_bandwidth_fraction=share.kv,
        matmul_fraction=share.matmul,
        matmul_dtype=used,
        allocatable_bytes=allocatable,
        source=share.source,
    )
    return ReplicaPlan(
        hardware=profile.name,
        quant=quant,
        context=context,
        concurrency=concurrency,
        kv_dtype=kv_dtype,
        fits=fits,
        tp=tp,
        devices=tp,
        max_tp=limit,
        memory_per_device_bytes=memory,
        usable_per_device_bytes=usable,
        weights_bytes=weights_bytes,
        weights_per_device_bytes=w_dev,
        kv_cache_bytes=kv_total,
        kv_per_device_bytes=kv_dev,
        kv_room_per_device_bytes=usable - w_dev,
        required_per_device_bytes=w_dev + kv_dev,
        decode_tokens_per_s=decode,
        decode_tokens_per_s_per_sequence=1 / step_s,
        prefill_tokens_per_s=context / ttft if ttft else None,
        ttft_s=ttft,
        matmul_dtype=used,
        matmul_tflops=tflops,
        cost_per_mtok=cost,
        basis=basis,
        explanation="; ".join(parts),
    )
