"""Quantize stage: one scheme's quantized weights, computed once and shared by every target that ships them.

Input: the ingested source. Output: `quant.store` (the quantized Linear tensors in
compressed-tensors' layout and the `quantization_config`), described by a `QuantizeRecord`. Every
export of that scheme (the targets listing it in `quantized_input`: hf-bundle, rocm-bundle, trtllm,
orbax's int8) takes it as its `quantized` input instead of quantizing again.

Schemes llm-compressor quantizes (GPTQ, AWQ, FP4) take `QuantizeParams.calibration` = {compute_dtype}, and those
that calibrate on text (GPTQ, AWQ, NVFP4's activation scales) also {samples, seq_len, skip_tokens} and the
calibration text (the external input `calibration_text`, from the store by its digest, which is in the key);
they are compute stages, placed on the build's device (`QuantizeParams.device`, `pipeline.placement`):
llm-compressor onloads one decoder layer at a time there.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from kiln.formats.hf_model import open_source, unrecorded, write_dequantized
from kiln.pipeline.placement import stage_device
from kiln.pipeline.records import QuantizeParams, QuantizeRecord
from kiln.pipeline.requirements import Requirements, Sizing, calibrated_requirements, placed_kind, requirements
from kiln.pipeline.stage import Node, Stage, StageContext, StageOutput
from kiln.pipeline.stages.ingest import open_ingested
from kiln.quant.catalog import get_scheme
from kiln.quant.rtn import check_shapes

if TYPE_CHECKING:
    from kiln.quant.store import QuantizedWeights


def run(ctx: StageContext) -> QuantizeRecord:
    from kiln.quant.store import write_quantized

    p = QuantizeParams.model_validate(ctx.node.params)
    scheme = p.scheme
    if scheme != get_scheme(scheme.name, scheme.lm_head):
        raise ValueError(f"scheme {scheme.name!r} in the plan differs from the preset of that name")
    source = open_ingested(ctx.input("ingest"))
    total = sum(t.nbytes for t in source.tensors.values())
    calibrated = None
    check_shapes(
        scheme, {n: t.shape for n, t in source.tensors.items()}, source.shape.merged_gemms()
    )  # before calibration spends any time
    if scheme.by_llmcompressor:
        from kiln.quant.calibrated import calibrate, calibration_samples

        cal = p.calibration
        assert cal is not None and cal.compute_dtype is not None  # QuantizeParams refuses a node without them
        samples = []
        if scheme.calibrated:
            assert cal.samples is not None and cal.seq_len is not None and cal.skip_tokens is not None
            text = ctx.external("calibration_text").read_text(encoding="utf-8")
            samples = calibration_samples(
                source.root, text, samples=cal.samples, seq_len=cal.seq_len, skip_tokens=cal.skip_tokens
            )
        # Calibration's offloaded weights live beside the stage's output, in its temporary directory: a
        # killed run leaves them inside the work dir's `.tmp-*` (never mistaken for done), not in /tmp.
        offload = ctx.out_dir.parent / "calibration-offload"
        offload.mkdir()
        calibrating = source
        if source.quantized is not None:
            # llm-compressor reads the model from disk through transformers: it gets the release dequantized, in the
            # dtype it computes in (`pipeline.requirements.stage_work` plans the copy's disk).
            plain = write_dequantized(source, offload / "dequantized-source", cal.compute_dtype)
            calibrating = open_source(plain, hasher=unrecorded)
        calibrated = calibrate(
            calibrating,
            scheme,
            samples,
            offload_dir=offload,
            compute_dtype=cal.compute_dtype,
            device=stage_device(ctx.node).torch,
        )
    try:
        result = write_quantized(
            source, scheme, ctx.out_dir, on_progress=lambda n: ctx.progress(n, total), calibrated=calibrated
        )
    finally:
        if calibrated is not None:
            del calibrated
            shutil.rmtree(offload, ignore_errors=True)
    return QuantizeRecord(**result, calibration=p.calibration.as_params() if p.calibration is not None else None)


def open_output(output: StageOutput) -> QuantizedWeights:
    from kiln.quant.store import open_quantized

    return open_quantized(output.files_dir, output.record(QuantizeRecord).scheme_name)


def needs(node: Node, sizing: Sizing) -> Requirements:
    """Round-to-nearest holds a tensor at a time; calibration one layer, its Hessians and activations, on
    every core and on the device it was placed on (`pipeline.requirements.calibrated`)."""
    p = QuantizeParams.model_validate(node.params)
    if not p.scheme.by_llmcompressor:
        return requirements("quantize", sizing, node)
    assert p.calibration is not None  # QuantizeParams refuses an llm-compressor scheme's node without it
    return calibrated_requirements(sizing, p.calibration, p.scheme.method, placed_kind(node))


def hint(node: Node) -> str:
    """What to try when quantizing fails: the recipe's other quants build without this one."""
    name = QuantizeParams.model_validate(node.params).scheme.name
    return f"without {name} in the recipe's targets, its other quants build"


STAGE = Stage(
    "quantize",
    # 4: a GPTQ scheme's quantization_config records its static column order (actorder); 5: every expert of a
    # mixture calibrated on every token, Mixtral's experts and routers by their checkpoint names, routers in `ignore`
    "5",
    run,
    QuantizeRecord,
    "quantize the Linear weights once per scheme (compressed-tensors layout)",
    needs=needs,
    hint=hint,
    params=QuantizeParams,
)
