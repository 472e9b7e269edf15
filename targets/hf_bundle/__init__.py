"""Target `hf-bundle`: an HF-format directory (config, tokenizer, SafeTensors shards) for vLLM and transformers.

bf16 copies the checkpoint's weights; every other method of the catalog (`quant.catalog`) is written in the
compressed-tensors format vLLM loads, from the shared quantize stage's output, except a release's own layout
(mxfp4-experts: gpt-oss's MXFP4 experts), written as the release stores it.
"""

from kiln.targets.base import TargetSpec, register
from kiln.targets.hf_bundle.export import CODE_VERSION, HARDWARE, QUANTIZED, QUANTS, export, scheme_compatibility
from kiln.targets.lint import lint_safetensors

SPEC = register(
    TargetSpec(
        name="hf-bundle",
        format="safetensors",
        quants=QUANTS,
        hardware=HARDWARE,
        runtime="transformers",
        serving_runtimes=("vllm",),
        code_version=CODE_VERSION,
        export=export,
        # What its export holds (at 8B, FP8 / INT8 / INT4 bundles: 0.98-1.1 GiB over the stage's start, about one
        # copy of the 1.05 GB embedding).
        export_tensor_copies={"*": 2.0},
        description="HF-format bundle loadable by vLLM (CUDA, ROCm) and transformers; quantized as compressed-tensors",
        quantized_input=QUANTIZED,
        quantized_head=True,
        compatibility_fn=scheme_compatibility,
        lint=lint_safetensors,
    )
)
