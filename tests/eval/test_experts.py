"""Which models transformers loads with their experts as one Linear per expert (`eval.runtimes.experts`): a
compressed-tensors bundle's, whose experts compressed-tensors quantizes Linear by Linear; a plain checkpoint or a
release's own quantization (FP8 block, MXFP4) as transformers loads it alone."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
from transformers.utils.quantization_config import QuantizationMethod

from kiln.eval.runtimes.experts import loading_experts

MOE = ["Qwen3MoeForCausalLM"]


@pytest.mark.parametrize(
    "quantization_config",
    [None, {"quant_method": "fp8", "weight_block_size": [128, 128]}, {"quant_method": "mxfp4"}],
)
def test_a_plain_or_release_quantized_model_loads_as_transformers_loads_it(quantization_config: Any) -> None:
    config = SimpleNamespace(architectures=MOE, quantization_config=quantization_config)
    assert isinstance(loading_experts(config), nullcontext)


@pytest.mark.parametrize(
    "quantization_config",
    [
        {"quant_method": "compressed-tensors"},
        SimpleNamespace(quant_method=QuantizationMethod.COMPRESSED_TENSORS),  # transformers' own config class
    ],
)
def test_a_compressed_tensors_bundle_with_experts_loads_them_as_linears(quantization_config: Any) -> None:
    config = SimpleNamespace(architectures=MOE, quantization_config=quantization_config)
    assert not isinstance(loading_experts(config), nullcontext)
    dense = SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config=quantization_config)
    assert isinstance(loading_experts(dense), nullcontext)
