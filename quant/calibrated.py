"""Calibrated int4 (GPTQ, AWQ) with llm-compressor's `oneshot`, on the stage's device, into the quantize stage's layout.

llm-compressor chooses the int4 values and scales from calibration text; kiln then stores them
exactly as for round-to-nearest (`store.write_quantized` with the module's own scales: the
compressed-tensors `pack-quantized` tensors and `quantization_config`), so hf-bundle and eval
need no change. The modifiers are built from kiln's `Scheme` (`compressed.ct_scheme`), not from
llm-compressor's preset names, so the scheme table stays the one source of truth.

- GPTQ (`GPTQModifier`, llm-compressor's default `actorder="static"`): per Linear, Hessian-based
  error feedback over the columns; the module's weight ends up fake-quantized (`q * scale`).
- AWQ (`transform.awq.AWQModifier`, then `QuantizationModifier`): per decoder layer, a grid
  search for per-input-channel smoothing scales that are folded into the layer before
  (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up, v -> o and up -> down where
  shapes allow), then min-max scales for round-to-nearest. The folded RMSNorm weights differ
  from the source's, so they are stored too (bf16, under their own names).

What llm-compressor 0.14 does here, on a machine without an accelerator (read in its source and
compressed-tensors 0.19's, and seen in its logs):

- `oneshot(pipeline="independent")` (its default) runs each modifier with its own pipeline:
  GPTQ and AWQ get the *sequential* pipeline, the `QuantizationModifier` after AWQ the data-free one.
  The sequential pipeline traces the model into one subgraph per decoder layer (plus the head) and
  calibrates them in turn, keeping every sample's activations at the layer boundary in an
  `IntermediatesCache` ("offloaded" to `sequential_offload_device="cpu"`: activations only, never
  weights).
- By itself "one layer at a time" bounds accelerator memory, not host memory: the pipeline
  *onloads* each subgraph's weights to `get_main_device()` (the CPU here) from wherever the model
  keeps them, and a model loaded with plain `from_pretrained` keeps them all in RAM. Measured
  (bench/calibration_memory.py, layers of 5.9 MB): peak RSS grew with depth by about the model's
  bytes for GPTQ and twice that for AWQ.
- Where weights are kept is compressed-tensors' offloading, which llm-compressor calibrates through
  unchanged: a module's `_parameters` become an `OffloadCache`. Loading under
  `compressed_tensors.offload.load_offloaded_model` with `device_map={"": "disk"}` gives every
  module a `DiskCache`: meta tensors plus an index into the source's own SafeTensors files
  (symlinked into the offload folder, nothing copied). The sequential pipeline reads one subgraph's
  weights under `disable_offloading()` and drops them when it moves on; everything calibration
  writes (GPTQ's fake-quantized weights, the scales, AWQ's smoothed norms and Linears) goes through
  `update_offload_parameter` to a new file in the offload folder. So host memory holds one layer's
  weights, its boundary activations and its Hessians (GPTQ, in*in float32 per Linear) or cached
  inputs (AWQ). `calibrate` loads this way, and its result reads each calibrated tensor from the
  offload folder when `write_quantized` asks for it (the folder goes when the result does). The
  numbers are bit-identical to calibrating the model in memory (checked by a test, GPTQ and AWQ).
  The price is disk: the folder grows to about the quantized Linears' bf16 bytes.
  The documented `device_map="auto_offload"` is not used: it fills RAM first (available memory
  minus 5 GB) and spills to disk only beyond that.
- The device: the sequential pipeline onloads each subgraph (one decoder layer's weights) and the
  calibration activations of that layer to `get_main_device()`, which is the first accelerator
  whenever one is visible, whatever the stage was placed on. `calibrate(device=...)` makes it the
  stage's device (`onload_device`): `cuda:N` calibrates one layer at a time on that GPU, with every
  other weight on disk and the boundary activations in host memory (so a 70B model calibrates on one
  80 GB GPU: one layer is ~1.7 GB of bf16 plus its Hessians), and `cpu` stays on the CPU even on a
  machine with a GPU. What calibration writes back is read to the CPU (`_read`).
- "One layer" is the layer's working set, not its weights: GPTQ accumulates an in_features² float32
  Hessian for every Linear of the layer during its forward (Llama-3-8B's width: 6 x 67 MB + 822 MB for
  down_proj, beside 436 MB of bf16 weights), then quantizes the Linears one at a time. Upstream's
  `prepare_batch` and activation ordering each held three copies of the Linear's Hessian at once,
  so down_proj's set the peak: 3.5 GB of anonymous memory over the import baseline, the same at 2 and
  4 layers (bench/calibration_memory.py). `gptq_single_hessian` keeps one copy (bit-identical); what
  remains is the forward's (weights + all Hessians) and down_proj's factorisation (torch's LAPACK calls
  copy the Hessian into column-major order: one more copy, inside llm-compressor's `factorize_hessian`).
- AWQ pins its cached activations (`IntermediatesCache.pin_memory`) before each grid search, for
  faster host-to-device copies; torch refuses to pin memory without an accelerator, so AWQ fails
  on CPU. `cpu_pin_memory_workaround` is the one place that works around it.
- A tied head (Gemma 3, the small Qwen models) shares the embedding's offloaded weight, which llm-compressor's own
  untie breaks on disk offload (it drops the shared entry). `untie_offloaded_head` gives the head its own entry
  linked to the same bytes before calibrating; kiln writes from the source's tensors, so the artifact stays tied.

Measured with `python bench/calibration_memory.py --threads 1` (Llama-shaped, hidden 512, 5.9 MB
of bf16 per layer; 4 samples of 64 tokens; 2 shared cores): peak RSS minus the ~506 MB that
importing torch, transformers, datasets and llm-compressor takes, for the model in memory (before)
and on disk (`calibrate` now); the 32-layer row is from a run with torch's default threads.

| layers | model MB | GPTQ in memory | GPTQ on disk | AWQ in memory | AWQ on disk |
|---:|---:|---:|---:|---:|---:|
| 4 | 25 | 136 MB | 139 MB | 146 MB | 98 MB |
| 8 | 48 | 165 MB | 124 MB | 190 MB | 94 MB |
| 16 | 95 | 201 MB | 126 MB | 284 MB | 96 MB |
| 32 | 190 | | 127 MB | | 108 MB |

On disk, memory no longer grows with depth; what remains (~100-125 MB, 84 MB on a 2-layer 3.7 MB
model) is torch's lazily initialised kernels, the traced subgraphs, tokenizer and dataset, and one
layer's working set. Time is unchanged within noise (16 layers: GPTQ 15.9 s in memory, 16.9 s on
disk; AWQ 25.8 s, 21.9 s). On the example model (examples/tiny-llama, 10.5 MB; 32 samples of 256
tokens; 1 thread): GPTQ 5 s, peak 594 MB (604 MB in memory), AWQ 22 s, peak 656 MB (687-699 MB);
AWQ's extra is its cached inputs of one layer for all samples, which grows with samples, not depth.

Mixtures of experts: transformers 5.17 holds a layer's experts as fused 3-D parameters; `linearize_experts` gives
each expert its own Linears and `oneshot(moe_calibrate_all_experts=True)` runs every calibration token through
every expert (only the routed outputs reach the layer's output), so an expert no token is routed to is calibrated
all the same; `model_tensor_names` maps what was calibrated back to the checkpoint's names (Mixtral's
`block_sparse_moe.experts.<e>.w1/w3/w2`), and `moe_awq_mappings` smooths the router with the experts.

Calibration samples: `samples` consecutive, non-overlapping windows of `seq_len` tokens (BOS first
when the model has one), from the text's tokens after `skip_tokens` — the build skips the tokens
the eval scores when calibrating on the eval's held-out text, so calibration never sees them. Too
little text is an error (`CALIBRATION_TOO_SHORT`), never fewer samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, StageFailed
from kiln.formats.architectures.record import TensorKind
from kiln.quant.rtn import kv_scale_names, quantizes, router_modules
from kiln.quant.schemes import Scheme

if TYPE_CHECKING:
    import torch

    from kiln.formats.hf_model import SourceModel


class CalibrationTooShort(InvalidInput):
    """The calibration text has fewer tokens than `samples * seq_len` after the skipped part."""

    code = Codes.CALIBRATION_TOO_SHORT


@dataclass(frozen=True)
class CalibratedWeights:
    """What calibration chose, by source tensor name (the input of `store.write_quantized`).

    `weights` and `scales` may read each tensor from disk when indexed: take them one at a time.
    """

    weights: Mapping[str, torch.Tensor]  # quantized Linear weight -> its (smoothed / fake-quantized) values
    scales: Mapping[str, torch.Tensor]  # quantized Linear weight -> its compressed-tensors weight_scale
    changed: Mapping[str, torch.Tensor]  # source tensors kept in bf16 that calibration changed (AWQ's norms)
    # quantized Linear weight -> its other parameters by local name (NVFP4: weight_global_scale,
    # input_global_scale; a float32 number each, so held in memory)
    qparams: Mapping[str, Mapping[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    # an FP8 KV cache's scales, `<layer>.self_attn.k_scale` / `v_scale` -> float32 [1] (new tensors, not the source's)
    kv_scales: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def calibration_samples(
    model_dir: str | Path, text: str, *, samples: int, seq_len: int, skip_tokens: int = 0
) -> list[list[int]]:
    """`samples` token windows of `seq_len` tokens from `text` (after its first `skip_tokens` tokens)."""
    from transformers import AutoTokenizer

    if samples < 1 or seq_len < 2 or skip_tokens < 0:
        raise InvalidInput(f"calibration needs samples >= 1 and seq_len >= 2; got {samples}, {seq_len}")
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    bos = config.get("bos_token_id")
    if bos is None:
        bos = tokenizer.bos_token_id
    head = [int(bos)] if bos is not None else []
    # verbose=False: the text is longer than model_max_length on purpose; windows keep within it.
    ids: list[int] = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][skip_tokens:]
    step = seq_len - len(head)
    need = samples * step
    if len(ids) < need:
        raise CalibrationTooShort(
            f"calibration text gives {len(ids)} token(s) after the {skip_tokens} skipped, but {samples} samples "
            f"of {seq_len} tokens need {need}; give a longer calibration.text or fewer samples / a shorter seq_len",
            details={
                "tokens": len(ids),
                "needed": need,
                "skipped": skip_tokens,
                "samples": samples,
                "seq_len": seq_len,
            },
        )
    return [head + ids[i * step : (i + 1) * step] for i in range(samples)]


@contextlib.contextmanager
def cpu_pin_memory_workaround() -> Iterator[None]:
    """Make llm-compressor's `IntermediatesCache.pin_memory` a no-op when there is no accelerator.

    llm-compressor 0.14's AWQ calls it before each smoothing grid search to speed up host-to-device
    copies, and `Tensor.pin_memory()` raises without an accelerator. With everything on the CPU
    there is nothing to copy, so skipping the pin changes no number. Remove this once
    `tests/pipeline/test_quantize_calibrated.py::test_upstream_awq_still_pins_memory_on_cpu` fails.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory

    def no_pin(self: Any, batch_index: int, input_names: list[str] | None = None) -> None:
        return None

    IntermediatesCache.pin_memory = no_pin  # type: ignore[method-assign]
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]


@contextlib.contextmanager
def offset_norm_restore_workaround() -> Iterator[None]:
    """Write AWQ's smoothed offset norms back into disk-offloaded modules.

    Gemma's RMSNorms scale by (1 + w). llm-compressor 0.14's `norm_calibration_context` (entered by `oneshot`)
    swaps each for a `CalibrationOffsetNorm` holding 1 + w, which AWQ divides by its smoothing scales, and on exit
    `restore` sets `original.weight.data` to the result minus 1. On an offloaded module `original.weight` is a
    copy read from the offload folder, so that assignment is lost: the checkpoint kept Gemma 3's
    pre_feedforward_layernorm unsmoothed while gate_proj / up_proj were scaled to match the smoothed one.
    Here `restore` writes through compressed-tensors' `update_offload_parameter`, as every other calibrated
    tensor is written, and only where calibration changed the norm: 1 + w held in bf16 is coarser than w (a step of
    2^-8 against w's own), so writing back a norm nothing smoothed would round it. Remove this once
    `tests/pipeline/test_quantize_calibrated.py::test_upstream_offset_norm_restore_still_loses_offloaded_weights`
    fails.
    """
    import torch
    from compressed_tensors.offload import update_offload_parameter
    from llmcompressor.modeling.offset_norm import CalibrationOffsetNorm

    original = CalibrationOffsetNorm.restore

    def restore(self: Any, module: torch.nn.Module) -> torch.nn.Module:
        weight = cast("torch.Tensor", module.weight)
        if not torch.equal(self.weight.data, (1.0 + weight.data.float()).to(self._orig_dtype)):
            update_offload_parameter(module, "weight", (self.weight.data.float() - 1.0).to(self._orig_dtype))
        return module

    CalibrationOffsetNorm.restore = restore  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        CalibrationOffsetNorm.restore = original  # type: ignore[method-assign]


def untie_offloaded_head(model: torch.nn.Module) -> bool:
    """Give a tied model's head (`lm_head`, its output embedding) a weight of its own, reading the embedding's bytes
    in the source's file; returns whether the head was tied.

    transformers ties the head by sharing the embedding's Parameter, so disk offload holds one meta tensor for both,
    under one entry of compressed-tensors' `DiskCache.index`. llm-compressor 0.14 unties the head whenever a
    modifier's targets take in an embedding (`untie_word_embeddings`, from `QuantizationMixin.start_calibration`):
    it deletes and re-registers the embedding's weight, which drops the shared entry, and reading the head's then
    fails (`KeyError: Parameter containing: tensor(..., device='meta')`); anything calibration wrote to a tied head
    would also have overwritten the embedding. Here the head gets its own meta tensor and index entry, a link to
    the same tensor of the source's SafeTensors file (nothing read or copied), and the config says untied, as
    llm-compressor's own untie leaves it. kiln writes its artifacts from the source's tensors, so a checkpoint that
    has no `lm_head.weight` gets none: the artifact stays tied (`tie_word_embeddings` is the source's config's).
    """
    import torch
    from compressed_tensors.offload import disable_onloading
    from compressed_tensors.offload.cache.disk import DiskCache

    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embed = get_input() if callable(get_input) else None
    head = get_output() if callable(get_output) else None
    if embed is None or head is None:
        return False
    with disable_onloading():  # the offloaded (meta) tensors themselves
        shared = embed.weight
        if head.weight is not shared:
            return False
        params = head._parameters
        if not isinstance(params, DiskCache) or shared not in DiskCache.index:
            raise StageFailed(
                f"the tied head of {type(model).__name__} is not offloaded to disk; calibration loads every weight so",
                code=Codes.CALIBRATION_FAILED,
            )
        own = torch.nn.Parameter(torch.empty_like(shared, device="meta"), requires_grad=shared.requires_grad)
        # The entry's file is a link into the offload folder; the new one links to what it resolves to, the source's.
        DiskCache.create_checkpoint_symlink(own, DiskCache.index[shared], params.offload_dir)
        params["weight"] = own  # with onloading disabled: stored as it is, nothing written
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False  # nothing ties them again (transformers' `tie_weights` asks the config)
    return True


@contextlib.contextmanager
def gptq_single_hessian() -> Iterator[None]:
    """Quantize each Linear with GPTQ holding one copy of its Hessian, not three (same numbers).

    llm-compressor 0.14 quantizes a layer's Linears one at a time off CUDA (`assign_batches`: batches of
    one). For each, `prepare_batch` divides the Hessian it pops by the sample count into a new tensor and
    stacks that into a third, and `apply_activation_ordering` (actorder "static") permutes both axes
    through two `torch.gather` outputs before copying back: three in_features² float32 matrices at once,
    twice per Linear. At Llama-3-8B's width down_proj's Hessian (in 14,336) is 822 MB, so quantizing it
    added 1.6 GB to a layer's working set (weights 436 MB, all seven Hessians 1.2 GB) and set the peak.

    Here a batch of one divides in place and is a view of its Hessian; on the CPU the permutation is
    done in place, the columns by blocks of rows and the rows by following the permutation's cycles with
    one row's buffer (a Python loop over rows: cheap on a CPU, a kernel launch per row on a GPU, where
    upstream's version stays). Division and data movement as upstream's: bit-identical results (tested
    against upstream's functions). Batches of several (CUDA) go to upstream's `prepare_batch`.
    """
    from llmcompressor.modifiers.gptq import base, gptq_quantize

    upstream_prepare, upstream_order = base.prepare_batch, gptq_quantize.apply_activation_ordering

    def prepare_batch(
        batch: list[torch.nn.Module],
        batch_qparams: list[dict[str, torch.Tensor]],
        hessians_by_module: dict[torch.nn.Module, torch.Tensor],
        num_samples_by_module: dict[torch.nn.Module, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if len(batch) != 1:
            return upstream_prepare(batch, batch_qparams, hessians_by_module, num_samples_by_module)
        return _prepare_one(batch[0], batch_qparams[0], hessians_by_module, num_samples_by_module)

    def apply_activation_ordering(
        weights: torch.Tensor, hessians: torch.Tensor, actorder: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if hessians.device.type != "cpu":
            return upstream_order(weights, hessians, actorder)  # type: ignore[no-any-return]
        return _order_in_place(weights, hessians, actorder, upstream_order)

    base.prepare_batch = prepare_batch
    gptq_quantize.apply_activation_ordering = apply_activation_ordering
    try:
        yield
    finally:
        base.prepare_batch = upstream_prepare
        gptq_quantize.apply_activation_ordering = upstream_order


def _prepare_one(
    module: torch.nn.Module,
    qparams: dict[str, torch.Tensor],
    hessians_by_module: dict[torch.nn.Module, torch.Tensor],
    num_samples_by_module: dict[torch.nn.Module, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """llm-compressor 0.14's `prepare_batch` for a batch of one module, without copying its Hessian."""
    import torch
    from llmcompressor.modifiers.gptq.helpers import GPTQ_PRECISION

    hessian = hessians_by_module.pop(module)
    num_samples = num_samples_by_module.pop(module).to(device=hessian.device)
    hessians = hessian.div_(num_samples).unsqueeze(0)  # the popped Hessian is GPTQ's to overwrite
    del hessian
    weight = cast("torch.Tensor", module.weight)
    weights = torch.empty((1, *weight.shape), device=weight.device, dtype=GPTQ_PRECISION)
    torch.stack([weight], out=weights)  # a disposable working copy
    scales = torch.stack([qparams["scale"]])
    zero_points = torch.stack([qparams["zero_point"]])
    global_scale = qparams["global_scale"]
    global_scales = torch.stack([global_scale.reshape(-1)[0]]) if global_scale is not None else None
    return weights, hessians, scales, zero_points, global_scales


def _order_in_place(
    weights: torch.Tensor, hessians: torch.Tensor, actorder: Any, upstream: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """llm-compressor 0.14's `apply_activation_ordering` with the Hessians permuted in place.

    `upstream` (its own function) handles no ordering and rejects unknown kinds; the permutation is the
    same argsort of the Hessians' diagonals, so the result is the same."""
    import torch
    from compressed_tensors.quantization.quant_args import ActivationOrdering

    if actorder not in (ActivationOrdering.WEIGHT, ActivationOrdering.STATIC):
        return upstream(weights, hessians, actorder)  # type: ignore[no-any-return]
    num_rows, num_columns = weights.shape[-2:]
    perm = torch.argsort(torch.diagonal(hessians, dim1=-2, dim2=-1), dim=-1, descending=True)
    block = max(1, (16 << 20) // (4 * num_columns))  # rows per column-permuting step: ~16 MB of buffer
    row = torch.empty(num_columns, dtype=hessians.dtype, device=hessians.device)
    for b in range(hessians.shape[0]):
        h, p = hessians[b], perm[b].to(device=hessians.device)
        for i in range(0, num_columns, block):  # new[r, c] = old[r, p[c]]
            h[i : i + block] = h[i : i + block].index_select(1, p)
        order = p.tolist()  # then new[r, :] = old[p[r], :], cycle by cycle
        done = bytearray(num_columns)
        for start in range(num_columns):
            if done[start] or order[start] == start:
                continue
            row.copy_(h[start])
            j = start
            while order[j] != start:
                done[j] = 1
                h[j].copy_(h[order[j]])
                j = order[j]
            done[j] = 1
            h[j].copy_(row)
    weight_perm = perm.to(device=weights.device)
    weights.copy_(torch.gather(weights, -1, weight_perm.unsqueeze(-2).expand(-1, num_rows, -1)))
    return weights, hessians, weight_perm


def _quiet_llmcompressor_logs() -> None:
    """Send llm-compressor's loguru output (on stdout by default, at INFO) to stderr, errors only.

    `kiln build --json` owns stdout; llm-compressor logs every module it quantizes there, and warns
    on import (hence the import under `redirect_stdout`). Its own environment variables
    (`LLM_COMPRESSOR_LOG_LEVEL`, ...) still take precedence.
    """
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        from llmcompressor import LoggerConfig, configure_logger, logger

    configure_logger(LoggerConfig(console_log_level=None))
    logger.add(sys.stderr, level="ERROR")


def _recipe(scheme: Scheme, ignore: list[str] | None = None, awq_mappings: list[Any] | None = None) -> list[Any]:
    """llm-compressor modifiers for `scheme`; AWQ is a transform followed by plain quantization (0.14 API).

    `ignore`: the model's modules left unquantized (default the scheme's; `calibrate` adds the routers);
    `awq_mappings`: AWQ's smoothing groups where llm-compressor's own for the model's class would be wrong
    (None: its own)."""
    if ignore is None:
        ignore = list(scheme.ignore)
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    from kiln.quant.compressed import ct_scheme

    if scheme.kv_cache is not None:
        if scheme.method != "rtn":
            raise ValueError(f"scheme {scheme.name!r}: an FP8 KV cache is calibrated beside round-to-nearest weights")
        from compressed_tensors.quantization import QuantizationArgs

        # The KV cache's scales only: the weights stay kiln's round-to-nearest (`quant.rtn`). `ignore` too: without
        # it the modifier's default targets (every Linear) take in `lm_head`, which the scheme keeps in bf16.
        return [QuantizationModifier(kv_cache_scheme=QuantizationArgs(**scheme.kv_cache.model_dump()), ignore=ignore)]
    groups = {"group_0": ct_scheme(scheme).model_copy(update={"format": None})}
    if scheme.method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=ignore)]
    if scheme.method == "awq":
        return [AWQModifier(mappings=awq_mappings), QuantizationModifier(config_groups=groups, ignore=ignore)]
    if scheme.method == "minmax":
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    raise ValueError(f"scheme {scheme.name!r} ({scheme.method}) is not quantized by llm-compressor")


# llm-compressor's per-expert Linears (`LinearExperts2D`'s `ExpertMLPWithGate`), by the kind of tensor each holds.
EXPERT_LINEARS: Final = {
    TensorKind.FFN_GATE_EXPS: "gate_proj",
    TensorKind.FFN_UP_EXPS: "up_proj",
    TensorKind.FFN_DOWN_EXPS: "down_proj",
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def linearize_experts(model: torch.nn.Module) -> dict[int, str]:
    """Give every expert of `model` its own Linears, in place; returns each sparse layer's experts module path.

    transformers 5.17 keeps a mixture's experts as fused 3-D parameters (`experts.gate_up_proj`
    [experts, 2 x intermediate, hidden], `experts.down_proj`), which no quantization modifier targets.
    llm-compressor 0.14's `LinearExperts2D` holds them as `experts.<e>.gate_proj` / `up_proj` / `down_proj`
    Linears and, under its `moe_calibration_context` (what `oneshot(moe_calibrate_all_experts=True)` enters),
    runs every token through every expert while adding only the routed ones' outputs to the layer's output:
    an expert no calibration token is routed to still gets a Hessian (GPTQ), smoothing statistics (AWQ) and
    activation scales, and the model computes what it computed before. llm-compressor's own
    `linearize_moe` reads a layer's fused tensors from the offload folder once per expert and projection (on the
    tiny Qwen3-MoE of 8 experts: 48 reads, 21 MB, against 4 reads, 1.6 MB here); here each module is
    linearized with offloading disabled, so its fused tensors are read once and dropped before the next."""
    from compressed_tensors.offload import disable_offloading
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    for name, module in get_non_linearized_moes(model):
        experts = cast(Any, module)  # a transformers fused experts module (llm-compressor's FusedExpertsProtocol)
        linear = LinearExperts2D.get_linear_experts_cls(type(experts))
        config = getattr(module, "config", None) or cast(Any, model).config
        with disable_offloading():
            replacement = linear.from_experts_module(experts, config)
        model.set_submodule(name, replacement)
    paths: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearExperts2D) and (m := _LAYER.search(name)) is not None:
            paths[int(m.group(1))] = name
    return paths


def model_tensor_names(source: SourceModel, model: torch.nn.Module, experts: Mapping[int, str]) -> dict[str, str]:
    """Every source tensor's name in the calibrated `model` (whose experts `linearize_experts` gave Linears).

    Most are the checkpoint's own names. An expert's projection is `<experts>.<e>.<gate_proj|up_proj|down_proj>`
    under the layer's experts module, whatever the checkpoint calls it (Mixtral's `w1` / `w3` / `w2`), and the
    router sits beside the experts under the record's name for it (transformers 5.17 names Mixtral's
    `block_sparse_moe` `mlp`). A name `model` lacks, or a tensor of another shape there, is CALIBRATION_FAILED."""
    from compressed_tensors.offload import disable_onloading

    moe = source.shape.arch.mlp.experts
    names: dict[str, str] = {}
    for t in source.shape.tensors():
        name = t.name
        if not _has_tensor(model, name) and t.layer is not None and t.layer in experts and moe is not None:
            if t.kind in EXPERT_LINEARS and t.expert is not None and not t.bias:
                name = f"{experts[t.layer]}.{t.expert}.{EXPERT_LINEARS[t.kind]}.weight"
            elif t.kind == TensorKind.FFN_GATE_INP and not t.bias:
                name = f"{experts[t.layer].rsplit('.', 1)[0]}.{moe.router}.weight"
        if not _has_tensor(model, name):
            raise StageFailed(f"the calibrated model has no tensor for {t.name!r}", code=Codes.CALIBRATION_FAILED)
        module, attr = name.rsplit(".", 1)
        with disable_onloading():  # an offloaded tensor's shape, without reading it
            shape = tuple(getattr(model.get_submodule(module), attr).shape)
        if shape != t.shape:
            raise StageFailed(
                f"the calibrated model's {name} is {list(shape)}, the checkpoint's {t.name} {list(t.shape)}",
                code=Codes.CALIBRATION_FAILED,
            )
        names[t.name] = name
    return names


def moe_awq_mappings(model: torch.nn.Module, experts: Mapping[int, str], router: str) -> list[Any] | None:
    """AWQ's smoothing groups for a mixture of experts llm-compressor 0.14 has none for (Mixtral); None where it has
    (Qwen3-MoE) or the model is dense.

    Its fallback for an unknown class is Llama's: post_attention_layernorm smoothed into `gate_proj` / `up_proj`,
    which matches every expert's but not the router that reads the same normalised input, so routing would change.
    These are its MoE groups (as for Qwen3-MoE): the norm into the router and every expert's gate and up, the
    attention's as Llama's, and each expert's up into its down."""
    from llmcompressor.modifiers.transform.awq import AWQ_MAPPING_REGISTRY, AWQMapping

    if not experts or type(model).__name__ in AWQ_MAPPING_REGISTRY:
        return None
    block, attr = next(iter(experts.values())).rsplit(".", 1)
    mlp = re.escape(block.rsplit(".", 1)[-1])
    return [
        AWQMapping("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
        AWQMapping("re:.*v_proj$", ["re:.*o_proj$"]),
        AWQMapping(
            "re:.*post_attention_layernorm$",
            [
                f"re:.*{mlp}\\.{re.escape(router)}$",
                f"re:.*{mlp}\\.{re.escape(attr)}\\.\\d+\\.gate_proj$",
                f"re:.*{mlp}\\.{re.escape(attr)}\\.\\d+\\.up_proj$",
            ],
        ),
        AWQMapping("re:.*up_proj$", ["re:.*down_proj$"]),
    ]


def _read(model: torch.nn.Module, name: str) -> torch.Tensor:
    """Parameter or buffer `name` of `model` on the CPU; an offloaded one is read from its file now (a fresh
    tensor; an offload cache hands it out on its onload device, a GPU after calibrating on one)."""
    module, attr = name.rsplit(".", 1)
    tensor: torch.Tensor = getattr(model.get_submodule(module), attr)
    return tensor.detach().cpu()


@contextlib.contextmanager
def onload_device(device: str) -> Iterator[None]:
    """Make llm-compressor's main device (where its pipelines onload each subgraph and its activations) the
    stage's `device`, not the first accelerator it finds.

    llm-compressor 0.14 asks `llmcompressor.utils.dev.get_main_device()` (imported by name into its
    sequential and data-free pipelines): `cuda:<rank>` whenever an accelerator is visible, so a stage
    placed on the CPU of a GPU machine would calibrate on the GPU, and one placed on `cuda:1` on `cuda:0`.
    """
    import torch
    from llmcompressor.pipelines.data_free import pipeline as data_free
    from llmcompressor.pipelines.sequential import pipeline as sequential
    from llmcompressor.utils import dev

    target = torch.device(device)
    modules = (dev, sequential, data_free)
    saved = [m.get_main_device for m in modules]

    def main_device() -> torch.device:
        return target

    for m in modules:
        m.get_main_device = main_device  # type: ignore[attr-defined]
    previous = torch.cuda.current_device() if target.type == "cuda" else None
    if target.type == "cuda":
        torch.cuda.set_device(target)  # what torch.accelerator.current_device_index() answers inside
    try:
        yield
    finally:
        for m, original in zip(modules, saved, strict=True):
            m.get_main_device = original  # type: ignore[attr-defined]
        if previous is not None:
            torch.cuda.set_device(previous)


def _has_tensor(model: torch.nn.Module, name: str) -> bool:
    """Whether `model` has parameter or buffer `name`, without reading it (an offload cache answers from its index)."""
    module_name, attr = name.rsplit(".", 1)
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    return attr in module._parameters or attr in module._buffers


class _OffloadFolder:
    """A temporary folder for offloaded weights, removed when the last mapping that reads from it is collected
    (or at exit): its lifetime is that of the calibration result, which the caller does not manage."""

    def __init__(self, parent: str | Path | None) -> None:
        self.path = tempfile.mkdtemp(prefix="kiln-calibration-", dir=parent)
        weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)


class _OffloadedTensors(Mapping[str, "torch.Tensor"]):
    """Tensors of a disk-offloaded model under names of our choosing, each read from disk when asked for."""

    def __init__(self, model: torch.nn.Module, names: Mapping[str, str], folder: _OffloadFolder) -> None:
        self._model = model
        self._names = dict(names)  # our name -> the model's
        self._folder = folder

    def __getitem__(self, name: str) -> torch.Tensor:
        return _read(self._model, self._names[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


COMPUTE_DTYPES = ("bfloat16", "float32")
# A quantized module's parameters besides its weight and scale that llm-compressor computes (NVFP4's tensor
# scales) and the checkpoint stores.
GLOBAL_SCALES = ("weight_global_scale", "input_global_scale")
# CPU flags of native bf16 arithmetic (x86: AVX512-BF16, AMX; Arm: the BF16 extension).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def calibration_dtype(cpuinfo: str | None = None, *, device: str = "cpu") -> str:
    """The dtype calibration computes in on `device` (a kind: cpu, cuda): bfloat16 on a GPU and on a CPU
    with native bf16 arithmetic, float32 elsewhere. AVX2-only CPUs emulate bf16 matmuls (AWQ's grid search
    took 230 s on one, 13.5 s on an AVX512-BF16 one); where bf16 is native it keeps memory and the offload folder at
    the checkpoint's size (float32 writes a converted copy of every weight to the offload folder,
    twice the checkpoint's bytes on disk) at about the same speed (bench/calibration_memory.py).
    `KILN_CALIBRATION_DTYPE` (bfloat16 | float32) overrides the detection."""
    override = os.environ.get("KILN_CALIBRATION_DTYPE")
    if override:
        if override not in COMPUTE_DTYPES:
            raise InvalidInput(
                f"KILN_CALIBRATION_DTYPE={override!r}; known: {', '.join(COMPUTE_DTYPES)}",
                details={"known": list(COMPUTE_DTYPES)},
            )
        return override
    if device != "cpu":  # every GPU kiln places calibration on (sm80+) computes bf16 natively
        return "bfloat16"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "float32"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags |= set(value.split())
    return "bfloat16" if flags & _BF16_FLAGS else "float32"


def oneshot_data(samples: list[list[int]]) -> dict[str, Any]:
    """`oneshot`'s calibration arguments for these token windows, in order; none for [] (data-free: llm-compressor's
    data-free pipeline observes each weight in turn)."""
    if not samples:
        return {}
    from datasets import Dataset

    return {
        "dataset": Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}),
        "num_calibration_samples": len(samples),
        "max_seq_length": max(len(s) for s in samples),
        "shuffle_calibration_samples": False,
    }


def _check_calibrated(
    scheme: Scheme, name: str, weight_scale: torch.Tensor, qparams: Mapping[str, torch.Tensor]
) -> None:
    """Refuse scales of zero, or not finite: what an observer that saw no calibration input can leave (an expert
    calibrated on its routed tokens only, where none was routed). MXFP4's scales are exponents (0 is 2^-127)."""
    import torch

    scale = weight_scale.float()
    bad = [k for k, v in qparams.items() if not bool(torch.isfinite(v.float()).all() and (v.float() > 0).all())]
    if scheme.format != "mxfp4-pack-quantized" and not bool(torch.isfinite(scale).all() and scale.any()):
        bad.insert(0, "weight_scale")
    if bad:
        raise StageFailed(
            f"{scheme.name}: calibration left {name} with {', '.join(bad)} zero or not finite",
            code=Codes.CALIBRATION_FAILED,
            details={"tensor": name, "parameters": bad},
        )


def calibrate(
    source: SourceModel,
    scheme: Scheme,
    samples: list[list[int]],
    *,
    offload_dir: str | Path | None = None,
    compute_dtype: str = "bfloat16",
    device: str = "cpu",
) -> CalibratedWeights:
    """Run llm-compressor's `oneshot` for `scheme` on `source`, one layer at a time on `device` (a torch
    device string: `cpu`, `cuda:0`), with every weight offloaded to disk.

    The model is loaded with compressed-tensors' disk offload (`load_offloaded_model`, every module
    on "disk"): its weights stay in the source's SafeTensors files until the sequential pipeline
    reads one decoder layer's, and what calibration changes is written to a temporary folder under
    `offload_dir` (default: the system's temporary directory; it should be a disk, not a tmpfs).
    The result's `weights` and `scales` read each tensor from there when asked for; the folder is
    removed once the result is dropped. `compute_dtype` (`calibration_dtype()` for this CPU) is what
    the model runs in while calibrating (recorded in the quantize stage's record).
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise InvalidInput(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}")
    if not scheme.by_llmcompressor:
        raise ValueError(f"scheme {scheme.name!r} ({scheme.method}) is not quantized by llm-compressor")
    if scheme.calibrated != bool(samples):
        raise ValueError(f"scheme {scheme.name!r}: calibration samples are given exactly when it calibrates")
    _quiet_llmcompressor_logs()  # first: importing llmcompressor logs to stdout
    import torch
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    folder = _OffloadFolder(offload_dir)
    with load_offloaded_model(AutoModelForCausalLM):
        # {"": "disk"}: no weight is loaded; unchanged ones are read from the source's files in place.
        model = AutoModelForCausalLM.from_pretrained(
            str(source.root), dtype=getattr(torch, compute_dtype), device_map={"": "disk"}, offload_folder=folder.path
        )
    untie_offloaded_head(model)  # a tied head (Gemma 3, small Qwen models) on its own weight: see its docstring
    experts = linearize_experts(model)
    names = model_tensor_names(source, model, experts)
    routers = [names[f"{r}.weight"].removesuffix(".weight") for r in router_modules(source.shape.tensors())]
    moe = source.shape.arch.mlp.experts
    recipe = _recipe(
        scheme,
        ignore=[*scheme.ignore, *routers],
        awq_mappings=moe_awq_mappings(model, experts, moe.router) if moe is not None else None,
    )
    with cpu_pin_memory_workaround(), offset_norm_restore_workaround(), gptq_single_hessian(), onload_device(device):
        # Every expert calibrated on every token (its output kept only where routed): see `linearize_experts`.
        oneshot(model=model, recipe=recipe, moe_calibrate_all_experts=True, **oneshot_data(samples))
    scales: dict[str, str] = {}
    qparams: dict[str, dict[str, torch.Tensor]] = {}
    changed: dict[str, torch.Tensor] = {}
    kv_scales: dict[str, torch.Tensor] = {}
    if scheme.kv_cache is not None:
        for name in kv_scale_names(source.tensors):
            if not _has_tensor(model, name):
                raise StageFailed(f"{scheme.name}: llm-compressor left no {name}", code=Codes.CALIBRATION_FAILED)
            kv_scales[name] = _read(model, name).float().reshape(1)
    rtn_weights = scheme.method == "rtn"  # only the KV cache was calibrated
    for n in source.tensors:
        if quantizes(scheme, n) and rtn_weights:
            continue
        if quantizes(scheme, n):
            module = names[n].removesuffix(".weight")
            zero = f"{module}.weight_zero_point"
            if not _has_tensor(model, f"{module}.weight_scale") or (
                _has_tensor(model, zero) and bool(_read(model, zero).float().any())
            ):
                raise StageFailed(
                    f"{scheme.name}: llm-compressor left {module} without symmetric scales",
                    code=Codes.CALIBRATION_FAILED,
                )
            scales[n] = f"{module}.weight_scale"
            qparams[n] = {
                local: _read(model, f"{module}.{local}")
                for local in GLOBAL_SCALES
                if _has_tensor(model, f"{module}.{local}")
            }
            _check_calibrated(scheme, n, _read(model, scales[n]), qparams[n])
            continue
        # One tensor in memory at a time; only those calibration changed (AWQ's norms and routers, small) are kept.
        t = _read(model, names[n])
        if not torch.equal(t.to(torch.bfloat16), source.tensor(n).to(torch.bfloat16)):
            changed[n] = t
    return CalibratedWeights(
        weights=_OffloadedTensors(model, {n: names[n] for n in scales}, folder),
        scales=_OffloadedTensors(model, scales, folder),
        changed=changed,
        qparams=qparams,
        kv_scales=kv_scales,
    )
