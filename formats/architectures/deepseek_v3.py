"""DeepSeek-V3 (DeepseekV3ForCausalLM, `deepseek_v3`; DeepSeek-R1 and V3.1 share it): multi-head latent attention
(queries through a `q_lora_rank` latent, keys and values through a `kv_lora_rank` latent with one rope key every
head shares, rope on `qk_rope_head_dim` of each head's `qk_nope_head_dim + qk_rope_head_dim`), the first
`first_k_dense_replace` layers dense (`intermediate_size`) and the rest a mixture of `n_routed_experts` SwiGLU
experts of `moe_intermediate_size` (`num_experts_per_tok` per token) beside `n_shared_experts` shared ones always
run (one MLP `n_shared_experts` x `moe_intermediate_size` wide); routed by sigmoid scores plus a correction bias,
within the best `topk_group` of `n_group` groups, weighted by the uncorrected scores (renormalised where
`norm_topk_prob`) times `routed_scaling_factor`. YaRN rope as config.json's `rope_scaling` gives it.

As transformers 5.17 defines it (models/deepseek_v3/{configuration,modeling}_deepseek_v3.py): its config's
defaults, the names `save_pretrained` writes (every expert's projections one by one, `mlp.experts.<e>.gate_proj`,
as its conversion mapping for `deepseek_v3` turns the fused experts back into; the router `mlp.gate.weight`
[experts, hidden] and its `mlp.gate.e_score_correction_bias` [experts], a float32 buffer; the shared experts
`mlp.shared_experts.{gate,up,down}_proj`).

The released checkpoint (deepseek-ai/DeepSeek-V3) stores every decoder Linear in FP8 E4M3 with 128 x 128 block
scales (`quantization_config`, `weight_scale_inv`) and carries one multi-token-prediction layer after the 61
decoder layers (`num_nextn_predict_layers: 1`, `model.layers.61.*`: embed_tokens, enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head and a decoder layer with experts). The record recognises that layer and
builds nothing from it (`PREDICTION_LAYERS`).

llama.cpp writes the family as `deepseek2` (gguf-py/gguf/constants.py `MODEL_ARCH.DEEPSEEK2`, its tensors
attn_q_a, attn_q_a_norm, attn_q_b, attn_kv_a_mqa, attn_kv_a_norm, attn_kv_b, attn_k_b, attn_v_b, exp_probs_b and
the `nextn.*` tensors; its converter, conversion/deepseek.py `DeepseekV2Model`, splits kv_b_proj into attn_k_b
(each head's key rows, transposed) and attn_v_b, stacks the experts and skips the prediction layer: `skip_mtp`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from formats.architectures.config import CONFIG_LIMITS, FamilyConfig, MlaShape, MoeShape, size
from formats.architectures.record import (
    Architecture,
    Attention,
    Experts,
    Mlp,
    PredictionLayers,
    TargetMapping,
    refused,
)

_LATER = "(a later step of issue 39)"


class DeepseekV3Config(FamilyConfig):
    """DeepSeek-V3's config.json, with transformers' DeepseekV3Config defaults. transformers sets `head_dim` to
    `qk_rope_head_dim` (the rope's width) and writes it with `qk_head_dim`; the released config has neither.
    transformers calls the prediction layers' count `num_mtp_layers` and writes it as `num_nextn_predict_layers`;
    either is read, and both must agree where both are given. Keys of DeepSeek's own
    modeling code that transformers does not read are checked against what it computes: `scoring_func` sigmoid,
    `topk_method` noaux_tc, `moe_layer_freq` 1."""

    q_lora_rank: int | None = size("lora_rank", 1536)  # null: one q_proj, no query latent
    kv_lora_rank: int = size("lora_rank", 512)
    qk_nope_head_dim: int = size("head_dim", 128)
    qk_rope_head_dim: int = size("head_dim", 64)
    v_head_dim: int = size("head_dim", 128)
    n_routed_experts: int = size("num_experts", 256)
    num_experts_per_tok: int = size("num_experts_per_tok", 8)
    moe_intermediate_size: int = size("moe_intermediate_size", 2048)
    n_shared_experts: int = size("shared_experts", 1)
    first_k_dense_replace: int = Field(default=3, ge=0, le=CONFIG_LIMITS["num_hidden_layers"])
    n_group: int = size("num_experts", 8)
    topk_group: int = size("num_experts", 4)
    routed_scaling_factor: float = Field(default=2.5, gt=0, le=1e3, allow_inf_nan=False)
    norm_topk_prob: bool = True
    num_nextn_predict_layers: int | None = Field(default=None, ge=0, le=CONFIG_LIMITS["prediction_layers"])
    num_mtp_layers: int | None = Field(default=None, ge=0, le=CONFIG_LIMITS["prediction_layers"])
    qk_head_dim: int | None = size("head_dim", None)
    rope_interleave: bool = True
    scoring_func: Literal["sigmoid"] | None = None
    topk_method: Literal["noaux_tc"] | None = None
    moe_layer_freq: Literal[1] | None = None

    @model_validator(mode="after")
    def _shapes(self) -> DeepseekV3Config:
        if self.head_dim is not None and self.head_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"head_dim={self.head_dim} is not qk_rope_head_dim={self.qk_rope_head_dim}, which transformers sets "
                "it to (the rope's width)"
            )
        if self.qk_head_dim is not None and self.qk_head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(
                f"qk_head_dim={self.qk_head_dim} is not qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.qk_nope_head_dim + self.qk_rope_head_dim}"
            )
        counts = (self.num_mtp_layers, self.num_nextn_predict_layers)
        if None not in counts and counts[0] != counts[1]:
            raise ValueError(
                f"num_mtp_layers={self.num_mtp_layers} and num_nextn_predict_layers={self.num_nextn_predict_layers} "
                "disagree"
            )
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if kv_heads is not None and kv_heads != heads:
            raise ValueError(
                f"num_key_value_heads={kv_heads} with num_attention_heads={heads}: MLA expands its latent to every "
                "head (transformers' DeepseekV3Attention repeats nothing)"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary embeddings")
        e, groups, top_groups, k = self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok
        if e % groups or e // groups < 2:
            raise ValueError(
                f"n_routed_experts={e} must split into n_group={groups} groups of at least 2 (each group is ranked "
                "by its two best experts)"
            )
        if top_groups > groups:
            raise ValueError(f"topk_group={top_groups} exceeds n_group={groups}")
        if k > top_groups * (e // groups):
            raise ValueError(
                f"num_experts_per_tok={k} exceeds the {top_groups * (e // groups)} experts of the "
                f"topk_group={top_groups} groups chosen"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} exceeds num_hidden_layers={self.num_hidden_layers}"
            )
        return self

    def mla(self) -> MlaShape:
        return MlaShape(
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope_interleave=self.rope_interleave,
        )

    def moe(self) -> MoeShape:
        return MoeShape(
            experts=self.n_routed_experts,
            experts_per_token=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            sparse_layers=tuple(range(self.first_k_dense_replace, self.num_hidden_layers)),
            shared_intermediate_size=self.n_shared_experts * self.moe_intermediate_size,
            groups=self.n_group,
            topk_groups=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def prediction_layers(self) -> int:
        """transformers' default: one."""
        counts = (self.num_nextn_predict_layers, self.num_mtp_layers)
        return next((c for c in counts if c is not None), 1)


PREDICTION_LAYERS = PredictionLayers(
    reason="DeepSeek-V3's multi-token-prediction layer serves speculative decoding only: transformers 5.17's "
    "DeepseekV3ForCausalLM does not load it (`_keys_to_ignore_on_load_unexpected = [r'model\\.layers\\.61.*']`), "
    "llama.cpp's converter skips it (DeepseekV2Model.skip_mtp), and vLLM runs it only as a draft model "
    "(`--speculative-config` with method deepseek_mtp); no target kiln writes yet serves speculative decoding, so it "
    "stays in the source and is left out of every artifact and eval"
)

RECORD = Architecture(
    family="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    model_types=("deepseek_v3",),
    config=DeepseekV3Config,
    attention=Attention(kind="mla"),
    mlp=Mlp(
        experts=Experts(
            softmax_then_topk=False,
            shared="shared_experts",
            scoring="sigmoid",
            score_correction_bias=True,
        )
    ),
    streams=False,  # transformers' DeepseekV3DecoderLayer is not yet checked in the layer-streamed forward
    prediction_layers=PREDICTION_LAYERS,
    targets={
        # llama.cpp's deepseek2: MLA's tensors under their own kinds' names, kv_b split into attn_k_b / attn_v_b
        # (formats.gguf.layout), the correction bias as exp_probs_b; the prediction layer left out, as its converter
        # does (skip_mtp).
        "gguf": TargetMapping(gguf_arch="deepseek2"),
        # orbax: MLA's tensors as stored (their latents replicated on the mesh), the experts stacked; kiln's JAX
        # forward computes MLA non-absorbed on a cache of latents, and the sigmoid group-limited router
        # (targets.orbax.forward).
        "orbax": TargetMapping(),
        "trtllm": refused(
            "kiln writes no TensorRT-LLM checkpoint for DeepseekV3ForCausalLM yet: its PyTorch backend "
            "(tensorrt_llm/_torch/models/modeling_deepseekv3.py) loads the MLA projections, FP8 block scales and the "
            f"prediction layer through its own weight mapping, which kiln's writer does not produce {_LATER}"
        ),
        "vllm": refused(
            "kiln has not yet checked vLLM 0.32 on DeepseekV3ForCausalLM: vLLM computes MLA through its own "
            "backends (CPU_MLA on the CPU build kiln evaluates with) and loads FP8 block weights with its block-FP8 "
            "kernels; until a tiny model's vLLM scores are compared with transformers', a bundle's vLLM eval is "
            f"recorded not evaluated {_LATER}"
        ),
    },
    description="MLA (latent q and kv, shared rope key), 3 dense then 256 experts top-8 with a shared expert, "
    "sigmoid group-limited routing, YaRN",
)
