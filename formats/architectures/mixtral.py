"""Mixtral (MixtralForCausalLM): Mistral's attention and, in every layer, `num_local_experts` SwiGLU experts of
`intermediate_size` (`block_sparse_moe.experts.<e>.w1` gate, `w3` up, `w2` down), `num_experts_per_tok` per
token by a softmax router (`block_sparse_moe.gate`), always renormalised over the chosen. llama.cpp writes
it as `llama` with stacked experts (its rows of q and k permuted as Llama's)."""

from __future__ import annotations

from pydantic import model_validator

from kiln.formats.architectures.config import FamilyConfig, MoeShape, size
from kiln.formats.architectures.record import (
    Architecture,
    Attention,
    Experts,
    LayerType,
    Mlp,
    Projections,
    TargetMapping,
)


class MixtralConfig(FamilyConfig):
    """Mixtral's config.json: the experts (`num_local_experts`, `num_experts_per_tok`); a window on every layer
    when `sliding_window` is given."""

    num_local_experts: int = size("num_experts")
    num_experts_per_tok: int = size("num_experts_per_tok")

    @model_validator(mode="after")
    def _top_k(self) -> MixtralConfig:
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_local_experts={self.num_local_experts}"
            )
        return self

    def layer_kinds(self) -> tuple[LayerType, ...]:
        kind: LayerType = "sliding_attention" if self.sliding_window is not None else "full_attention"
        return (kind,) * self.num_hidden_layers

    def moe(self) -> MoeShape:
        return MoeShape(
            experts=self.num_local_experts,
            experts_per_token=self.num_experts_per_tok,
            intermediate_size=self.intermediate_size,
            norm_topk_prob=True,
            sparse_layers=tuple(range(self.num_hidden_layers)),
        )


RECORD = Architecture(
    family="mixtral",
    hf_class="MixtralForCausalLM",
    model_types=("mixtral",),
    config=MixtralConfig,
    attention=Attention(sliding="all"),
    mlp=Mlp(experts=Experts(block="block_sparse_moe", projections=Projections(gate="w1", up="w3", down="w2"))),
    targets={
        "gguf": TargetMapping(gguf_arch="llama", permute_qk=True),
        "orbax": TargetMapping(),
        # TensorRT-LLM main (2026): tensorrt_llm/_torch/models/modeling_mixtral.py (the router a Linear built with
        # quant_config=None; block_sparse_moe.experts.<e>.w1/w2/w3 load into the fused MoE as named) and
        # checkpoints/hf/mixtral_weight_mapper.py. The TensorRT backend's MODEL_MAP maps MixtralForCausalLM to
        # LLaMAForCausalLM: examples/models/core/mixtral/README.md converts with the llama converter.
        "trtllm": TargetMapping(
            trtllm_architecture="MixtralForCausalLM",
            trtllm_assumes=(
                (
                    "no_binding_window",
                    "TensorRT-LLM's MixtralAttention (modeling_mixtral.py) has no window: it would attend past a "
                    "sliding window shorter than the context",
                ),
            ),
            trtllm_converter="llama",
        ),
        "vllm": TargetMapping(),
    },
    description="mixture of experts (8 experts, top-2), GQA",
)
