"""Phi-3 (Phi3ForCausalLM): q, k and v in one Linear (`self_attn.qkv_proj`, [q + 2 kv, hidden]) and gate and up
in one (`mlp.gate_up_proj`, [2 x intermediate, hidden], gate first); every layer slides when config.json gives
`sliding_window`. llama.cpp's `phi3` keeps both fused (gate_up as its `ffn_up`)."""

from __future__ import annotations

from kiln.formats.architectures.config import FamilyConfig
from kiln.formats.architectures.record import Architecture, Attention, LayerType, Mlp, TargetMapping, TensorKind

# Why TensorRT-LLM loads no quantized Phi-3 kiln writes.
_FUSED_SPLIT = (
    "TensorRT-LLM's Phi3ForCausalLM.load_weights (modeling_phi3.py) splits the fused qkv_proj and gate_up_proj by "
    "rows and hands each part its weight alone (PR #6761 adds the fused weight_scale, for ModelOpt's per-tensor FP8): "
    "a fused Linear's per-channel, block, NVFP4 or int4 scales would not load"
)


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
        # TensorRT-LLM main (2026): tensorrt_llm/_torch/models/modeling_phi3.py; the TensorRT backend's
        # examples/models/core/phi/convert_checkpoint.py converts Phi-3.
        "trtllm": TargetMapping(
            trtllm_architecture="Phi3ForCausalLM",
            trtllm_refused=tuple(
                (algo, _FUSED_SPLIT) for algo in ("FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "W4A16_AWQ", "NVFP4")
            ),
            trtllm_assumes=(
                (
                    "no_binding_window",
                    "TensorRT-LLM's Phi3Attention (modeling_phi3.py) has no window: it would attend past a sliding "
                    "window shorter than the context",
                ),
            ),
            trtllm_converter="phi",
        ),
        "vllm": TargetMapping(),
    },
    description="dense, fused qkv and gate_up projections",
)
