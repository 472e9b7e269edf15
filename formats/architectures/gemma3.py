"""Gemma 3 text (Gemma3ForCausalLM, `gemma3_text`): sliding-window and global layers (five sliding to one global
by default: `layer_types`, or `sliding_window_pattern`), each type with its own rope base (global 1,000,000,
sliding 10,000; a scaling, where given, on the global layers only), per-head q/k RMSNorm, a norm before and
after both attention and MLP, RMSNorms that scale by (1 + w), the embedding scaled by sqrt(hidden_size), a
GELU (tanh) gated MLP, attention scaled by `query_pre_attn_scalar`^-1/2, and a tied head. llama.cpp's `gemma3`
(norm weights stored as 1 + w)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator

from kiln.formats.architectures.config import FamilyConfig, RopeParameters, RopeSpec, rope_spec, size
from kiln.formats.architectures.record import Architecture, Attention, LayerType, Mlp, Norms, TargetMapping

_Cap = Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
# transformers' Gemma3TextConfig.default_theta.
GLOBAL_THETA = 1_000_000.0
LOCAL_THETA = 10_000.0
DEFAULT_PATTERN = 6


class Gemma3Config(FamilyConfig):
    """Gemma 3's config.json (transformers' Gemma3TextConfig): its activation is `hidden_activation`; head_dim
    defaults to 256 and the window to 4,096; `rope_local_base_freq` is the sliding layers' rope base in configs
    written before `rope_parameters` held one per layer type."""

    activation_key: ClassVar[str] = "hidden_activation"

    head_dim: int | None = size("head_dim", 256)
    sliding_window: int | None = size("sliding_window", 4096)
    hidden_activation: str = Field(default="gelu_pytorch_tanh", max_length=64)
    query_pre_attn_scalar: float = Field(default=256, gt=0, le=1e6, allow_inf_nan=False)
    final_logit_softcapping: _Cap | None = None
    attn_logit_softcapping: _Cap | None = None
    rope_local_base_freq: float | None = Field(default=None, gt=0, le=1e12, allow_inf_nan=False)
    sliding_window_pattern: int | None = Field(default=None, gt=0, le=1024)
    use_bidirectional_attention: bool | None = None

    @field_validator("use_bidirectional_attention")
    @classmethod
    def _causal(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("must be false: a bidirectional Gemma 3 is an encoder, not a causal LM")
        return v

    def activation(self) -> str:
        return self.hidden_activation

    def layer_kinds(self) -> tuple[LayerType, ...]:
        if self.layer_types is not None:
            return super().layer_kinds()
        pattern = self.sliding_window_pattern or DEFAULT_PATTERN
        return tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.num_hidden_layers)
        )

    def rope(self) -> dict[LayerType, RopeSpec]:
        """The global layers' rope: `rope_parameters["full_attention"]` updated with `rope_scaling`, its base else
        `rope_theta` (default 1,000,000); the sliding layers': `rope_parameters["sliding_attention"]`, else
        `rope_local_base_freq` (default 10,000), never scaled (transformers' `convert_rope_params_to_dict`)."""
        nested: dict[str, Any] = self.rope_parameters or {}
        full = dict(nested.get("full_attention") or {})
        full.update(self.rope_scaling or {})  # transformers updates the global layers' parameters with it
        full.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else GLOBAL_THETA)
        local = dict(nested.get("sliding_attention") or {})
        local.setdefault("rope_theta", self.rope_local_base_freq or LOCAL_THETA)
        out: dict[LayerType, RopeSpec] = {}
        for kind, params in (("full_attention", full), ("sliding_attention", local)):
            if kind in self.layer_kinds():
                p = RopeParameters.model_validate(params)
                out[kind] = rope_spec(p, float(p.rope_theta or 0.0))  # type: ignore[index]
        return out


RECORD = Architecture(
    family="gemma3",
    hf_class="Gemma3ForCausalLM",
    model_types=("gemma3_text",),
    config=Gemma3Config,
    attention=Attention(qk_norm=True, sliding="layer_types"),
    mlp=Mlp(activations=("gelu_pytorch_tanh",)),
    norms=Norms(offset=1.0, sandwich=True, embedding_scale="sqrt_hidden"),
    tied_default=True,
    targets={
        "gguf": TargetMapping(gguf_arch="gemma3"),
        "orbax": TargetMapping(),
        # TensorRT-LLM main (2026): tensorrt_llm/_torch/models/modeling_gemma3.py (sliding layers from
        # config.layer_types, with their window and local rope base; the embedding scaled by sqrt(hidden)) and
        # checkpoints/hf/gemma3_weight_mapper.py, which adds the 1 to every norm as it loads (the checkpoint keeps
        # transformers' w). The TensorRT backend converts Gemma 3 with examples/models/core/gemma/ (its README's
        # "Run Gemma 3").
        "trtllm": TargetMapping(
            trtllm_architecture="Gemma3ForCausalLM",
            trtllm_assumes=(
                (
                    "no_softcapping",
                    "TensorRT-LLM's Gemma3 (modeling_gemma3.py) applies no attention or final logit softcapping",
                ),
            ),
            trtllm_converter="gemma",
        ),
        "vllm": TargetMapping(),
    },
    description="dense, 5:1 sliding-window:global layers, q/k RMSNorm, (1 + w) sandwich norms, tied head",
)
