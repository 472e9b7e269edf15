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

TensorRT-LLM's PyTorch backend reads transformers' names and DeepSeek's own FP8 spelling (`weight_scale_inv`,
`quant_method: fp8`), which its trtllm fp8-block checkpoint is written in (the record's `trtllm` mapping).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.formats.architectures.config import CONFIG_LIMITS, FamilyConfig, MlaShape, MoeShape, size
from kiln.formats.architectures.record import (
    Architecture,
    Attention,
    Experts,
    Mlp,
    PredictionLayers,
    TargetMapping,
)


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
    # transformers' DeepseekV3 hard-codes sigmoid scores, the correction bias and every layer past the dense ones
    # sparse; vLLM's DeepseekV2MoE reads `scoring_func` (softmax when absent) and builds the correction bias only
    # for `topk_method: noaux_tc` (model_executor/models/deepseek_v2.py), and TensorRT-LLM's decoder layers read
    # `moe_layer_freq` (the config schema admits 1 alone): the release's config.json has all three, one transformers
    # writes none.
    implied_config=(("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")),
    targets={
        # llama.cpp's deepseek2: MLA's tensors under their own kinds' names, kv_b split into attn_k_b / attn_v_b
        # (formats.gguf.layout), the correction bias as exp_probs_b; the prediction layer left out, as its converter
        # does (skip_mtp).
        "gguf": TargetMapping(gguf_arch="deepseek2"),
        # orbax: MLA's tensors as stored (their latents replicated on the mesh), the experts stacked; kiln's JAX
        # forward computes MLA non-absorbed on a cache of latents, and the sigmoid group-limited router
        # (targets.orbax.forward).
        "orbax": TargetMapping(),
        # TensorRT-LLM's PyTorch backend (tensorrt_llm/_torch/models/modeling_deepseekv3.py,
        # `DeepseekV3WeightLoader.load_weights`) reads transformers' names: q_a_proj and kv_a_proj_with_mqa fused
        # (their weights and `weight_scale_inv` concatenated by rows), kv_b_proj split into k_b / v_b per head (from
        # the weights dequantized with `weight_scale_inv` under FP8 block scales: model_config.py's
        # `load_hf_quant_config` excludes `*kv_b_proj*`), each expert's gate/up/down as w1/w3/w2 with
        # `<e>.w1.weight_scale_inv` (DeepSeekFP8BlockScalesFusedMoEMethod), `mlp.gate.weight` and its
        # `e_score_correction_bias` (DeepseekV3Gate.load_weights). Its FP8 block checkpoints are DeepSeek's own
        # (`quant_method: fp8`, 128 x 128 `weight_block_size`): the fp8-block scheme is written so.
        "trtllm": TargetMapping(
            trtllm_architecture="DeepseekV3ForCausalLM",
            trtllm_release_layouts=("fp8-block",),
            # The prediction layer is left out, as from every artifact (`PREDICTION_LAYERS`): TensorRT-LLM builds its
            # MTP modules only for MTP speculative decoding (`DeepseekV3ForCausalLM.__init__`, spec_config's
            # `is_mtp`), so the checkpoint serves without it; MTP speculative decoding would look for
            # `model.layers.<L>.*` and not find them. config.json keeps the source's count, as kiln's lint compares.
            # Every decoder layer reads `moe_layer_freq` (`layer_idx % config.moe_layer_freq`): `implied_config`.
            trtllm_assumes=(
                (
                    "norm_topk_prob",
                    "TensorRT-LLM's Deepseekv3RoutingImpl.noaux_tc (modeling_deepseekv3.py) always renormalises the "
                    "chosen experts' scores before routed_scaling_factor, which computes norm_topk_prob true",
                ),
                (
                    "blocks_of_128",
                    "TensorRT-LLM's DeepSeek-V3 under FP8 block scales needs whole 128-wide blocks: intermediate_size "
                    "and the shared experts' width (`_compute_mlp_tp_size`, `_compute_shared_expert_tp_size` assert "
                    "it), moe_intermediate_size (DeepSeekFP8BlockScalesFusedMoEMethod asserts it) and q_lora_rank "
                    "(DeepseekV3WeightLoader concatenates q_a_proj's block scales above kv_a_proj_with_mqa's)",
                ),
            ),
            trtllm_refused=(
                (
                    "NVFP4",
                    "TensorRT-LLM's DeepseekV3WeightLoader reads q_a_proj and kv_a_proj_with_mqa as one fused Linear "
                    "from their `weight` and `weight_scale_inv` alone, and kv_b_proj's scales as `weight_scale_inv`: "
                    "NVFP4's weight_scale, weight_scale_2 and input_scale for them are never loaded (NVIDIA's own "
                    "DeepSeek NVFP4 checkpoints keep attention out of NVFP4)",
                ),
            ),
            trtllm_no_converter="kiln pins no TensorRT-backend converter for DeepseekV3ForCausalLM (no "
            "examples/models/core/<converter>/convert_checkpoint.py kiln knows writes it): the checkpoint serves the "
            "PyTorch backend",
        ),
        # vLLM 0.32 (DeepseekV3ForCausalLM through deepseek_v2.py; its CPU build: MLA of DeepSeek's latent only,
        # eval.runtimes.vllm_support.mla_cpu_limitation), scored against transformers in
        # tests/eval/test_vllm_frontier.py.
        "vllm": TargetMapping(),
    },
    description="MLA (latent q and kv, shared rope key), 3 dense then 256 experts top-8 with a shared expert, "
    "sigmoid group-limited routing, YaRN",
)
