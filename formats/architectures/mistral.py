"""Mistral (MistralForCausalLM): Llama's layout; every layer slides when config.json gives `sliding_window`."""

from __future__ import annotations

from kiln.formats.architectures.config import FamilyConfig
from kiln.formats.architectures.record import Architecture, Attention, LayerType, TargetMapping


class MistralConfig(FamilyConfig):
    """Mistral's config.json: a window (`sliding_window`, null for none) applies to every layer."""

    def layer_kinds(self) -> tuple[LayerType, ...]:
        kind: LayerType = "sliding_attention" if self.sliding_window is not None else "full_attention"
        return (kind,) * self.num_hidden_layers


RECORD = Architecture(
    family="mistral",
    hf_class="MistralForCausalLM",
    model_types=("mistral",),
    config=MistralConfig,
    attention=Attention(sliding="all"),
    targets={
        "gguf": TargetMapping(gguf_arch="llama", permute_qk=True),
        "orbax": TargetMapping(),
        "trtllm": TargetMapping(trtllm_architecture="MistralForCausalLM", trtllm_converter="llama"),
        "vllm": TargetMapping(),
    },
    description="dense, GQA, SwiGLU, optional sliding window on every layer",
)
