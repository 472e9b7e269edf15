"""gpt-oss (GptOssForCausalLM, `gpt_oss`): grouped-query attention with biases on q, k, v and o and one learned
sink logit per head (`self_attn.sinks` [heads]: a softmax column that takes probability and gives no value),
layers alternating a 128-token sliding window and full attention (`layer_types`, sliding first), YaRN rope, and in
every layer a mixture of `num_local_experts` experts, `num_experts_per_tok` per token: a router with a bias
(`mlp.router.weight` [experts, hidden], `mlp.router.bias`), top-k of its logits then a softmax over those, and
experts stacked in one tensor per projection with biases (`mlp.experts.gate_up_proj` [experts, hidden, 2 x
intermediate], gate and up interleaved, `gate_up_proj_bias`, `down_proj` [experts, intermediate, hidden],
`down_proj_bias`) computing a clamped SwiGLU: gate ≤ 7, up in [-7, 7], gate · sigmoid(1.702 · gate) · (up + 1).
No shared expert.

As transformers 5.17 defines it (models/gpt_oss/{configuration,modeling}_gpt_oss.py: GptOssExperts' alpha 1.702
and limit 7.0; GptOssConfig's defaults: head_dim 64, window 128, rope base 150,000 with YaRN factor 32 over 4,096
positions, attention biases on). transformers has no conversion mapping for `gpt_oss`: `save_pretrained` writes the
stacked experts as the model holds them.

The released checkpoints (openai/gpt-oss-120b, openai/gpt-oss-20b) store the experts' weights as MXFP4
(`quantization_config` "mxfp4": `gate_up_proj_blocks` [experts, 2 x intermediate, hidden / 32, 16] and
`gate_up_proj_scales` [experts, 2 x intermediate, hidden / 32], uint8, rows the outputs; `down_proj_blocks` and
`_scales` likewise; transformers' integrations/mxfp4.py `Mxfp4GptOssExperts`, `convert_moe_packed_tensors`) and
everything else in bf16 (`modules_to_not_convert`: attention, router, embeddings, head):
`ModelShape.stored_tensors` names both spellings.

llama.cpp writes the family as `gpt-oss` (gguf-py/gguf/constants.py `MODEL_ARCH.GPT_OSS`: attn_sinks, the
post-attention norm as attn_post_norm, the experts as ffn_gate_exps / ffn_up_exps / ffn_down_exps with biases;
its converter, conversion/gpt_oss.py `GptOssModel`, de-interleaves gate_up and repacks MXFP4 blocks as they are).
TensorRT-LLM's PyTorch backend reads transformers' names and the release's MXFP4 experts as stored, which trtllm keeps
(the record's `trtllm` mapping).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from kiln.formats.architectures.config import FamilyConfig, MoeShape, RopeParameters, RopeSpec, rope_spec, size
from kiln.formats.architectures.record import (
    Architecture,
    Attention,
    Experts,
    LayerType,
    Mlp,
    TargetMapping,
    TensorKind,
)

# Why no quantized scheme of kiln's serves gpt-oss in TensorRT-LLM: its MLPBlock builds the fused MoE with the
# checkpoint's quant config (`create_moe(model_config=...)`, modeling_gpt_oss.py), and kiln's schemes quantize 2-D
# Linears only.
_EXPERTS_STAY_BF16 = (
    "kiln's schemes leave the stacked experts in bf16, and TensorRT-LLM's gpt-oss MLPBlock builds its fused MoE with "
    "the checkpoint's quantization (create_moe(model_config=...)), so the experts would be read as quantized"
)
# transformers' GptOssConfig: `default_theta` and the rope parameters its __post_init__ sets where none are given.
DEFAULT_THETA = 150_000.0
DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# GptOssExperts (transformers 5.17, the bf16 experts) clamps at 7.0 whatever the config says; its MXFP4 class reads
# `swiglu_limit`: a config with another limit is computed two ways.
SWIGLU_LIMIT = 7.0


class GptOssConfig(FamilyConfig):
    """gpt-oss's config.json, with transformers' GptOssConfig defaults. transformers names the expert count
    `num_local_experts` (`num_experts` an alias: both must agree where both are given); the released config's
    `experts_per_token` (OpenAI's own key) is not read by transformers, nor here."""

    num_local_experts: int = size("num_experts", 128)
    num_experts: int | None = size("num_experts", None)
    num_experts_per_tok: int = size("num_experts_per_tok", 4)
    head_dim: int | None = size("head_dim", 64)
    sliding_window: int | None = size("sliding_window", 128)
    max_position_embeddings: int = size("max_position_embeddings", 131072)
    rms_norm_eps: float = Field(default=1e-5, gt=0, lt=1, allow_inf_nan=False)
    swiglu_limit: float = Field(default=SWIGLU_LIMIT, gt=0, le=1e6, allow_inf_nan=False)

    @model_validator(mode="after")
    def _experts(self) -> GptOssConfig:
        if self.num_experts is not None and self.num_experts != self.num_local_experts:
            raise ValueError(f"num_experts={self.num_experts} and num_local_experts={self.num_local_experts} disagree")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_local_experts={self.num_local_experts}"
            )
        if self.swiglu_limit != SWIGLU_LIMIT:
            raise ValueError(
                f"swiglu_limit={self.swiglu_limit}: transformers' GptOssExperts clamps at {SWIGLU_LIMIT} whatever "
                "the config says (its MXFP4 experts read the key), so the model would compute two ways"
            )
        return self

    def layer_kinds(self) -> tuple[LayerType, ...]:
        """config.json's `layer_types`, else transformers' default: even layers slide, odd ones are full."""
        if self.layer_types is not None:
            return super().layer_kinds()
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers))

    def rope(self) -> dict[LayerType, RopeSpec]:
        """Every layer's rope: `rope_scaling` or `rope_parameters` as config.json gives them, else transformers'
        YaRN default; the base `rope_theta` (150,000 by default)."""
        if self.rope_scaling is not None or self.rope_parameters is not None:
            params = self.rope_scaling or self.rope_parameters or {}
            p = RopeParameters.model_validate(params)
            theta = self.rope_theta if self.rope_theta is not None else p.rope_theta
        else:
            p, theta = RopeParameters.model_validate(DEFAULT_ROPE), self.rope_theta
        spec = rope_spec(p, theta if theta is not None else DEFAULT_THETA)
        return {kind: spec for kind in sorted(set(self.layer_kinds()))}

    def moe(self) -> MoeShape:
        return MoeShape(
            experts=self.num_local_experts,
            experts_per_token=self.num_experts_per_tok,
            intermediate_size=self.intermediate_size,
            norm_topk_prob=True,  # a softmax over the chosen experts' logits: weights that sum to 1
            sparse_layers=tuple(range(self.num_hidden_layers)),
        )


RECORD = Architecture(
    family="gpt_oss",
    hf_class="GptOssForCausalLM",
    model_types=("gpt_oss",),
    config=GptOssConfig,
    attention=Attention(bias=True, output_bias=True, sliding="layer_types", sinks=True),
    mlp=Mlp(
        experts=Experts(
            router="router",
            router_bias=True,
            softmax_then_topk=False,
            layout="fused",
            bias=True,
            activation="clamped_swiglu",
        )
    ),
    streams=False,  # transformers' GptOssDecoderLayer is not yet checked in the layer-streamed forward
    targets={
        # llama.cpp's gpt-oss: the norm before the experts is its post_attention_norm; the stacked gate_up split
        # into ffn_gate_exps / ffn_up_exps and down_proj transposed (formats.gguf.layout); MXFP4 experts kept.
        "gguf": TargetMapping(gguf_arch="gpt-oss", names=((TensorKind.FFN_NORM, "post_attention_norm"),)),
        # orbax: the stacked experts as [experts, out, in] gate, up and down stacks (gate_up de-interleaved), with
        # their biases; kiln's JAX forward computes sinks, the top-k-then-softmax router with its bias, the clamped
        # SwiGLU and YaRN (targets.orbax.forward).
        "orbax": TargetMapping(),
        # TensorRT-LLM's PyTorch backend (tensorrt_llm/_torch/models/modeling_gpt_oss.py, `GptOssForCausalLM.
        # load_hf_weights`) reads transformers' names (`hf_params_map`: attn -> self_attn, gate -> router): q/k/v and
        # o with their biases, `self_attn.sinks` (cast to float32, AttentionBlock.load_weights), the router's weight
        # and bias, and the stacked experts either in bf16 (`gate_up_proj` [E, hidden, 2I] de-interleaved, `down_proj`,
        # their biases) or as the release stores them (`gate_up_proj_blocks` / `_scales`, `down_proj_blocks` /
        # `_scales`, config.json's `quant_method: mxfp4`: `ModelConfig.load_hf_quant_config`), so a release's MXFP4
        # experts are kept as released.
        "trtllm": TargetMapping(
            trtllm_architecture="GptOssForCausalLM",
            trtllm_release_layouts=("mxfp4",),
            trtllm_assumes=(
                (
                    "even_layers_slide",
                    "TensorRT-LLM's gpt-oss AttentionBlock (modeling_gpt_oss.py) slides the even layers and lets the "
                    "odd ones attend to everything (`sliding_window if layer_idx % 2 == 0 else None`), whatever "
                    "layer_types says",
                ),
                (
                    "yarn_rope_scaling",
                    "TensorRT-LLM's gpt-oss AttentionBlock (modeling_gpt_oss.py) computes YaRN rope whatever the "
                    "config's rope_type, from `rope_theta` and `rope_scaling`'s factor, "
                    "original_max_position_embeddings, beta_fast and beta_slow, read by key",
                ),
            ),
            trtllm_refused=tuple(
                (algo, f"{why}; {_EXPERTS_STAY_BF16}")
                for algo, why in (
                    ("FP8_PER_CHANNEL_PER_TOKEN", "TensorRT-LLM's fused MoE has no FP8 rowwise method"),
                    ("FP8_BLOCK_SCALES", "TensorRT-LLM's fused MoE would read FP8 block-scaled experts"),
                    ("W4A16_AWQ", "TensorRT-LLM's fused MoE has no per-group int4 weight-only method"),
                    (
                        "NVFP4",
                        "CutlassFusedMoE's NVFP4 cannot load gpt-oss's 1-D expert biases (its `can_implement`)",
                    ),
                )
            ),
            trtllm_no_converter="kiln pins no TensorRT-backend converter for GptOssForCausalLM: the checkpoint serves "
            "the PyTorch backend",
        ),
        # vLLM 0.32 (GptOssForCausalLM: sinks in its CPU attention, the experts in its CPU fused MoE), scored against
        # transformers in tests/eval/test_vllm_frontier.py.
        "vllm": TargetMapping(),
    },
    description="GQA with biases and sinks, 128-token sliding and full layers alternating, experts top-4 with "
    "biases and a clamped SwiGLU, YaRN",
)
