"""Qwen3 (Qwen3ForCausalLM): Qwen2's layout without biases and with a per-head RMSNorm on q and k after their
projections (`q_norm`, `k_norm`, [head_dim]); llama.cpp's `qwen3`."""

from __future__ import annotations

from formats.architectures.qwen2 import QwenConfig
from formats.architectures.record import Architecture, Attention, TargetMapping, refused

RECORD = Architecture(
    family="qwen3",
    hf_class="Qwen3ForCausalLM",
    model_types=("qwen3",),
    config=QwenConfig,
    attention=Attention(qk_norm=True, sliding="layer_types"),
    targets={
        "gguf": TargetMapping(gguf_arch="qwen3"),
        "orbax": TargetMapping(),
        "trtllm": refused("kiln writes no TensorRT-LLM checkpoint for this family yet"),
        "vllm": TargetMapping(),
    },
    description="dense, GQA, q/k RMSNorm, SwiGLU",
)
