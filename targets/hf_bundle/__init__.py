"""Target `hf-bundle`: an HF-format directory (config, tokenizer, SafeTensors shards) for vLLM and transformers."""

from targets.base import TargetSpec, register
from targets.hf_bundle.export import CODE_VERSION, HARDWARE, QUANTS, export

SPEC = register(
    TargetSpec(
        name="hf-bundle",
        format="safetensors",
        quants=QUANTS,
        hardware=HARDWARE,
        runtime="transformers",
        code_version=CODE_VERSION,
        export=export,
        description="HF-format bundle loadable by vLLM (CUDA, ROCm) and transformers",
    )
)
