"""Qwen3 (Qwen3ForCausalLM): Qwen2's layout without biases and with a per-head RMSNorm on q and k after their
projections (`q_norm`, `k_norm`, [head_dim]); llama.cpp's `qwen3`."""

from __future__ import annotations

from kiln.formats.architectures.qwen2 import QwenConfig
from kiln.formats.architectures.record import Architecture, Attention, TargetMapping

RECORD = Architecture(
    family="qwen3",
    hf_class="Qwen3ForCausalLM",
    model_types=("qwen3",),
    config=QwenConfig,
    attention=Attention(qk_norm=True, sliding="layer_types"),
    targets={
        "gguf": TargetMapping(gguf_arch="qwen3"),
        "orbax": TargetMapping(),
        # TensorRT-LLM main (2026): tensorrt_llm/_torch/models/modeling_qwen3.py.
        "trtllm": TargetMapping(
            trtllm_architecture="Qwen3ForCausalLM",
            trtllm_assumes=(
                (
                    "no_binding_window",
                    "TensorRT-LLM's Qwen3DecoderLayer (modeling_qwen3.py) gives its attention no window: it would "
                    "attend past a sliding window shorter than the context",
                ),
            ),
            trtllm_no_converter="the TensorRT backend's qwen convert_checkpoint.py refuses model_type qwen3 "
            "(0.21.0; NVIDIA/TensorRT-LLM issue #5450): only the PyTorch backend serves Qwen3",
        ),
        "vllm": TargetMapping(),
    },
    description="dense, GQA, q/k RMSNorm, SwiGLU",
)
