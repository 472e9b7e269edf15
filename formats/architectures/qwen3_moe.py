"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k RMSNorm) and, in its sparse layers, a mixture of
`num_experts` SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` per token chosen by a softmax
router (`mlp.gate`), renormalised over the chosen when `norm_topk_prob`; no shared expert. A layer is dense
(`intermediate_size`) when listed in `mlp_only_layers` or off the `decoder_sparse_step` (transformers'
Qwen3MoeDecoderLayer). llama.cpp's `qwen3moe`."""

from __future__ import annotations

from pydantic import Field, model_validator

from kiln.formats.architectures.config import CONFIG_LIMITS, FamilyConfig, MoeShape, size
from kiln.formats.architectures.record import Architecture, Attention, Experts, LayerType, Mlp, TargetMapping


class Qwen3MoeConfig(FamilyConfig):
    """Qwen3-MoE's config.json. transformers names the expert count `num_experts` and writes it as
    `num_local_experts`; either is read, and both must agree where both are given."""

    num_experts: int | None = size("num_experts", None)
    num_local_experts: int | None = size("num_experts", None)
    num_experts_per_tok: int = size("num_experts_per_tok")
    moe_intermediate_size: int = size("moe_intermediate_size")
    norm_topk_prob: bool = False
    decoder_sparse_step: int = size("decoder_sparse_step", 1)
    mlp_only_layers: list[int] = Field(default_factory=list, max_length=CONFIG_LIMITS["num_hidden_layers"])

    @model_validator(mode="after")
    def _experts(self) -> Qwen3MoeConfig:
        counts = {c for c in (self.num_experts, self.num_local_experts) if c is not None}
        if not counts:
            raise ValueError("num_experts (or num_local_experts) is required")
        if len(counts) > 1:
            raise ValueError(f"num_experts={self.num_experts} and num_local_experts={self.num_local_experts} disagree")
        if self.num_experts_per_tok > self.expert_count:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {self.expert_count} experts")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad or len(set(self.mlp_only_layers)) != len(self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers must list distinct layers 0..{self.num_hidden_layers - 1}")
        return self

    @property
    def expert_count(self) -> int:
        return self.num_experts or self.num_local_experts or 0

    def layer_kinds(self) -> tuple[LayerType, ...]:
        kind: LayerType = (
            "sliding_attention" if self.use_sliding_window and self.sliding_window is not None else "full_attention"
        )
        return (kind,) * self.num_hidden_layers

    def moe(self) -> MoeShape:
        sparse = tuple(
            i
            for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )
        return MoeShape(
            experts=self.expert_count,
            experts_per_token=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            sparse_layers=sparse,
        )


RECORD = Architecture(
    family="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    model_types=("qwen3_moe",),
    config=Qwen3MoeConfig,
    attention=Attention(qk_norm=True, sliding="all"),
    mlp=Mlp(experts=Experts()),
    targets={
        "gguf": TargetMapping(gguf_arch="qwen3moe"),
        "orbax": TargetMapping(),
        # TensorRT-LLM main (2026): tensorrt_llm/_torch/models/modeling_qwen3_moe.py, its HF weight mapper
        # (checkpoints/hf/qwen3_moe_weight_mapper.py, via qwen2_moe_weight_mapper.py: experts.<e>.gate_proj/up_proj/
        # down_proj become the fused MoE's w1/w3/w2), the router a plain bf16 parameter (Qwen3Gate).
        "trtllm": TargetMapping(
            trtllm_architecture="Qwen3MoeForCausalLM",
            trtllm_assumes=(
                (
                    "every_layer_sparse",
                    "TensorRT-LLM's Qwen3MoEDecoderLayer (modeling_qwen3_moe.py) builds a routed MoE block in every "
                    "layer: a dense layer (mlp_only_layers, decoder_sparse_step > 1) would not load",
                ),
                (
                    "norm_topk_prob",
                    "TensorRT-LLM routes Qwen3-MoE with RoutingMethodType.Renormalize (top-k, then a softmax over the "
                    "chosen experts: modeling_qwen3_moe.py), which computes norm_topk_prob true",
                ),
                (
                    "no_binding_window",
                    "TensorRT-LLM's Qwen3MoEDecoderLayer gives its attention no window: it would attend past a "
                    "sliding window shorter than the context",
                ),
            ),
            trtllm_no_converter="Qwen3MoeForCausalLM is not in the TensorRT backend's tensorrt_llm.models.MODEL_MAP "
            "(NVIDIA/TensorRT-LLM issue #5978): only the PyTorch backend serves Qwen3-MoE",
        ),
        "vllm": TargetMapping(),
    },
    description="mixture of experts (top-k of many, no shared expert), GQA, q/k RMSNorm",
)
