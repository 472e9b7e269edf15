"""Calibrated int4 (GPTQ, AWQ) with llm-compressor's `oneshot`, on CPU, into the quantize stage's layout.

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

What llm-compressor 0.14 does here, on a machine without an accelerator (read in its source, and
seen in its logs):

- `oneshot(pipeline="independent")` (its default) runs each modifier with its own pipeline:
  GPTQ and AWQ get the *sequential* pipeline, the `QuantizationModifier` after AWQ the data-free one.
  The sequential pipeline traces the model into one subgraph per decoder layer (plus the head) and
  calibrates them in turn, keeping every sample's activations at the layer boundary in an
  `IntermediatesCache` ("offloaded" to `sequential_offload_device="cpu"`).
- "One layer at a time" bounds accelerator memory, not host memory: without an accelerator
  `get_main_device()` is the CPU, so the whole model is loaded (bf16, `from_pretrained`) and stays
  in RAM. Peak RSS is the model + one layer boundary's activations for all samples + one layer's
  Hessians (GPTQ, in*in float32 per Linear) or cached layer inputs (AWQ), plus torch itself.
- AWQ pins its cached activations (`IntermediatesCache.pin_memory`) before each grid search, for
  faster host-to-device copies; torch refuses to pin memory without an accelerator, so AWQ fails
  on CPU. `cpu_pin_memory_workaround` is the one place that works around it.

Measured on the example model (examples/tiny-llama, 10.5 MB bf16; 32 samples of 256 tokens; 2 CPU
cores): quantize stage GPTQ 2.8 s, AWQ 8.3 s (int4-rtn 0.03 s); peak RSS of a process running only
that stage (VmHWM) GPTQ 540 MB, AWQ 647 MB, int4-rtn 373 MB, of which importing torch,
transformers, datasets and llmcompressor alone is 454 MB.

Calibration samples: `samples` consecutive, non-overlapping windows of `seq_len` tokens (BOS first
when the model has one), from the text's tokens after `skip_tokens` — the build skips the tokens
the eval scores when calibrating on the eval's held-out text, so calibration never sees them. Too
little text is an error (`CALIBRATION_TOO_SHORT`), never fewer samples.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import InvalidInput, StageFailed
from pipeline.quantize.rtn import quantizes
from targets.schemes import Scheme

if TYPE_CHECKING:
    import torch

    from pipeline.ingest import SourceModel


class CalibrationTooShort(InvalidInput):
    """The calibration text has fewer tokens than `samples * seq_len` after the skipped part."""

    code = "CALIBRATION_TOO_SHORT"


@dataclass(frozen=True)
class CalibratedWeights:
    """What calibration chose, by source tensor name (the input of `store.write_quantized`)."""

    weights: Mapping[str, torch.Tensor]  # quantized Linear weight -> its (smoothed / fake-quantized) values
    scales: Mapping[str, torch.Tensor]  # quantized Linear weight -> its compressed-tensors weight_scale
    changed: Mapping[str, torch.Tensor]  # source tensors kept in bf16 that calibration changed (AWQ's norms)


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


def _recipe(scheme: Scheme) -> list[Any]:
    """llm-compressor modifiers for `scheme`; AWQ is a transform followed by plain quantization (0.14 API)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    from pipeline.quantize.compressed import ct_scheme

    groups = {"group_0": ct_scheme(scheme).model_copy(update={"format": None})}
    if scheme.method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=list(scheme.ignore))]
    if scheme.method == "awq":
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=list(scheme.ignore))]
    raise ValueError(f"scheme {scheme.name!r} ({scheme.method}) is not calibrated")


def calibrate(source: SourceModel, scheme: Scheme, samples: list[list[int]]) -> CalibratedWeights:
    """Run llm-compressor's `oneshot` for `scheme` on `source` (CPU) and collect what it chose."""
    if not scheme.calibrated:
        raise ValueError(f"scheme {scheme.name!r} ({scheme.method}) is not calibrated")
    _quiet_llmcompressor_logs()  # first: importing llmcompressor logs to stdout
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source.root), dtype=torch.bfloat16)
    data = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
    with cpu_pin_memory_workaround():
        oneshot(
            model=model,
            dataset=data,
            recipe=_recipe(scheme),
            num_calibration_samples=len(samples),
            max_seq_length=max(len(s) for s in samples),
            shuffle_calibration_samples=False,
        )
    state = model.state_dict()
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    changed: dict[str, torch.Tensor] = {}
    for n in source.tensors:
        if n not in state:
            raise StageFailed(f"{scheme.name}: the calibrated model has no tensor {n!r}", code="CALIBRATION_FAILED")
        if quantizes(scheme, n):
            module = n.removesuffix(".weight")
            zero = state.get(f"{module}.weight_zero_point")
            if f"{module}.weight_scale" not in state or (zero is not None and bool(zero.any())):
                raise StageFailed(
                    f"{scheme.name}: llm-compressor left {module} without symmetric scales", code="CALIBRATION_FAILED"
                )
            weights[n] = state[n].detach()
            scales[n] = state[f"{module}.weight_scale"].detach()
        elif not torch.equal(state[n].detach().to(torch.bfloat16), source.tensor(n).to(torch.bfloat16)):
            changed[n] = state[n].detach()
    return CalibratedWeights(weights=weights, scales=scales, changed=changed)
