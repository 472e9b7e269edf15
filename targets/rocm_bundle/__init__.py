"""Target `rocm-bundle`: an hf-bundle for one AMD GPU architecture of the catalog, served by vLLM on ROCm.

Records the vLLM / ROCm / gfx runtime it is validated for and the FP8 flavour its hardware computes
in; for gfx942 it can carry FP8 weights pre-converted to float8_e4m3fnuz.
"""

from kiln.targets.base import TargetSpec, register
from kiln.targets.hf_bundle.export import QUANTIZED
from kiln.targets.lint import lint_safetensors
from kiln.targets.rocm_bundle.export import (
    CODE_VERSION,
    QUANTS,
    ROCM_ARCHES,
    arch_hardware,
    check_params,
    export,
    rocm_compatibility,
)

SPEC = register(
    TargetSpec(
        name="rocm-bundle",
        format="safetensors",
        quants=QUANTS,
        hardware=tuple(hw for arch in ROCM_ARCHES for hw in arch_hardware(arch)),
        runtime="transformers",
        serving_runtimes=("vllm",),
        code_version=CODE_VERSION,
        export=export,
        # What its export holds (hf-bundle's writer (measured there: about one copy of the largest tensor at 8B)).
        export_tensor_copies={"*": 2.0},
        description="HF-format bundle for vLLM on one AMD architecture (gfx942, gfx950), with its validated runtime",
        quantized_input=QUANTIZED,
        quantized_head=True,
        compatibility_fn=rocm_compatibility,
        check_params=check_params,
        lint=lint_safetensors,
    )
)
