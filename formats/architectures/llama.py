"""Llama (LlamaForCausalLM): grouped-query attention, a SwiGLU MLP, RMSNorm; llama.cpp's `llama` with q/k rows
permuted to its interleaved rope layout."""

from __future__ import annotations

from kiln.formats.architectures.config import FamilyConfig
from kiln.formats.architectures.record import Architecture, TargetMapping


class LlamaConfig(FamilyConfig):
    """Llama's config.json: the shared keys only."""


RECORD = Architecture(
    family="llama",
    hf_class="LlamaForCausalLM",
    model_types=("llama",),
    config=LlamaConfig,
    targets={
        "gguf": TargetMapping(gguf_arch="llama", permute_qk=True),
        "orbax": TargetMapping(),
        "trtllm": TargetMapping(trtllm_architecture="LlamaForCausalLM", trtllm_converter="llama"),
        "vllm": TargetMapping(),
    },
    description="dense, GQA, SwiGLU",
)
