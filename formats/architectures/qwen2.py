"""Qwen2 (Qwen2ForCausalLM): Llama's layout with q/k/v biases; llama.cpp's `qwen2` (NEOX rope, HF's own
layout, so nothing is permuted). Layers from `max_window_layers` on slide when `use_sliding_window` is set."""

from __future__ import annotations

from pydantic import Field

from kiln.formats.architectures.config import CONFIG_LIMITS, FamilyConfig
from kiln.formats.architectures.record import Architecture, Attention, LayerType, TargetMapping


class QwenConfig(FamilyConfig):
    """Qwen2 / Qwen3's config.json: `use_sliding_window` turns on a window for layers `max_window_layers`
    onwards, unless `layer_types` says otherwise (transformers' Qwen2Config / Qwen3Config)."""

    max_window_layers: int = Field(default=28, ge=0, le=CONFIG_LIMITS["num_hidden_layers"])

    def layer_kinds(self) -> tuple[LayerType, ...]:
        if self.layer_types is not None:
            return super().layer_kinds()
        window = self.sliding_window if self.use_sliding_window else None
        return tuple(
            "sliding_attention" if window is not None and i >= self.max_window_layers else "full_attention"
            for i in range(self.num_hidden_layers)
        )

    def window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window and "sliding_attention" in self.layer_kinds() else None


RECORD = Architecture(
    family="qwen2",
    hf_class="Qwen2ForCausalLM",
    model_types=("qwen2",),
    config=QwenConfig,
    attention=Attention(bias=True, sliding="layer_types"),
    targets={
        "gguf": TargetMapping(gguf_arch="qwen2"),
        "orbax": TargetMapping(),
        "trtllm": TargetMapping(trtllm_architecture="Qwen2ForCausalLM", trtllm_converter="qwen"),
        "vllm": TargetMapping(),
    },
    description="dense, GQA with q/k/v biases, SwiGLU",
)
