"""Target `trtllm`: the HF-format checkpoint TensorRT-LLM's PyTorch backend loads, and engines per GPU SKU.

FP8 schemes are written as compressed-tensors (which transformers also reads, so they are evaluated
on CPU here); int4 schemes in ModelOpt's W4A16_AWQ layout with hf_quant_config.json (evaluated only by
tensorrt_llm on a GPU runner: deferred here). `params.engines` asks for a TensorRT engine per SKU,
built by `pipeline.stages.engine` where a pinned tensorrt_llm and that GPU exist. See
`targets.trtllm.formats` for the per-scheme choices and their sources.
"""

from targets.base import TargetSpec, register
from targets.trtllm.engines import engine_artifacts
from targets.trtllm.export import (
    CODE_VERSION,
    HARDWARE,
    QUANTIZED,
    QUANTS,
    check_params,
    check_quant_params,
    export,
    trtllm_compatibility,
)
from targets.trtllm.formats import FORMATS, REFUSED

SPEC = register(
    TargetSpec(
        name="trtllm",
        format="safetensors",
        quants=QUANTS,
        hardware=HARDWARE,
        runtime="transformers",
        code_version=CODE_VERSION,
        export=export,
        description="TensorRT-LLM checkpoint (PyTorch backend): compressed-tensors FP8 or ModelOpt W4A16_AWQ; "
        "optional engines per GPU SKU",
        quantized_input=QUANTIZED,
        compatibility_fn=trtllm_compatibility,
        check_params=check_params,
        check_quant_params=check_quant_params,
        unsupported_quants=REFUSED,
        derived=engine_artifacts,
        quant_runtimes={q: f.eval_runtime for q, f in FORMATS.items() if f.eval_runtime != "transformers"},
    )
)
