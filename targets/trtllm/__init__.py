"""Target `trtllm`: the HF-format checkpoint TensorRT-LLM's PyTorch backend loads, and engines per GPU SKU.

FP8 schemes are written as compressed-tensors (which transformers also reads, so they are evaluated
on CPU here); int4 schemes in ModelOpt's W4A16_AWQ layout with hf_quant_config.json (evaluated only by
tensorrt_llm on a GPU runner: deferred here). `params.gpus` evaluates each checkpoint with
tensorrt_llm's PyTorch backend on a GPU of each SKU; `params.legacy_engines` builds TensorRT engines per
SKU with a release that still has trtllm-build. Both are stages of the target's own, declared as data in
`targets.trtllm.stages` and run by the pipeline's derived stage, where that GPU and the pinned tensorrt_llm
exist; they are deferred elsewhere. See `targets.trtllm.formats` for the per-scheme choices and their
sources, `targets.trtllm.engines` for the per-SKU jobs' params, commands and runners.

Families: each architecture record's `trtllm` mapping (`formats.architectures`) names the architecture TensorRT-LLM's
PyTorch backend registers, the QuantAlgos its model's loader cannot read, what its model class assumes of the config
and the legacy converter; the fused MoE's limits (`formats.MOE_REFUSED`) apply to every family with experts. A model
the backend would not load or would compute differently is refused at plan time (`check_model`). A family whose model
class reads a release's own layout (`trtllm_release_layouts`: DeepSeek-V3's FP8 block scales, gpt-oss's MXFP4
experts) is written in it, the release's bytes kept (docs/targets.md, "DeepSeek-V3 and gpt-oss").
"""

from kiln.targets.base import TargetSpec, register
from kiln.targets.lint import lint_safetensors
from kiln.targets.trtllm.export import (
    CODE_VERSION,
    HARDWARE,
    QUANTIZED,
    QUANTS,
    check_model,
    check_params,
    check_quant_params,
    export,
    trtllm_compatibility,
)
from kiln.targets.trtllm.formats import FORMATS, REFUSED
from kiln.targets.trtllm.stages import derived_nodes

SPEC = register(
    TargetSpec(
        per_architecture=True,
        name="trtllm",
        format="safetensors",
        quants=QUANTS,
        hardware=HARDWARE,
        runtime="transformers",
        code_version=CODE_VERSION,
        export=export,
        # What its export holds (at 8B, FP8: 0.98 GiB over the stage's start, about one copy of the 1.05 GB embedding).
        export_tensor_copies={"*": 2.0},
        description="TensorRT-LLM checkpoint (PyTorch backend): compressed-tensors FP8 or ModelOpt W4A16_AWQ; "
        "optional engines per GPU SKU",
        quantized_input=QUANTIZED,
        compatibility_fn=trtllm_compatibility,
        check_params=check_params,
        check_quant_params=check_quant_params,
        check_model_fn=check_model,
        unsupported_quants=REFUSED,
        derived=derived_nodes,
        quant_runtimes={q: f.eval_runtimes for q, f in FORMATS.items()},
        lint=lint_safetensors,
    )
)
