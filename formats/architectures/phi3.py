"""Phi-3 (Phi3ForCausalLM): q, k and v in one Linear (`self_attn.qkv_proj`, [q + 2 kv, hidden]) and gate and up
in one (`mlp.gate_up_proj`, [2 x intermediate, hidden], gate first); every layer slides when config.json gives
`sliding_window`. llama.cpp's `phi3` keeps both fused (gate_up as its `ffn_up`)."""

from __future__ import annotations

from formats.architectures.config import FamilyConfig
from formats.architectures.record import Architecture, Attention, LayerType, Mlp, TargetMapping, TensorKind, refused


class Phi3Config(FamilyConfig):
    """Phi-3's config.json: a window on every layer when `sliding_window` is given; `partial_rotary_factor`
    (top-level, or in `rope_parameters`)."""

    def layer_kinds(self) -> tuple[LayerType, ...]:
        kind: LayerType = "sliding_attention" if self.sliding_window is not None else "full_attention"
        return (kind,) * self.num_hidden_layers


RECORD = Architecture(
    family="phi3",
    hf_class="Phi3ForCausalLM",
    model_types=("phi3",),
    config=Phi3Config,
    attention=Attention(fused_qkv=True, partial_rotary=True, sliding="all"),
    mlp=Mlp(fused_gate_up=True),
    targets={
        "gguf": TargetMapping(gguf_arch="phi3", names=((TensorKind.FFN_GATE_UP, "ffn_up"),)),
        "orbax": TargetMapping(),
        "trtllm": refused("kiln writes no TensorRT-LLM checkpoint for this family yet"),
        "vllm": TargetMapping(),
    },
    description="dense, fused qkv and gate_up projections",
)
