"""A compressed-tensors bundle's mixture of experts in transformers: one quantized Linear per expert projection.

transformers 5.17 holds a family's experts fused, as 3-D parameters (`mlp.experts.gate_up_proj`
[experts, 2 x intermediate, hidden], `mlp.experts.down_proj` [experts, hidden, intermediate]), and its
loader merges a checkpoint's per-expert tensors into them (`conversion_mapping.py`'s WeightConverters).
For a compressed-tensors bundle it first dequantizes each expert's weight
(`integrations.compressed_tensors.DecompressExperts`), which leaves the experts unlike every other
Linear of the bundle:

- FP8 weights are multiplied by their scale and rounded to bfloat16, and a float32 forward then fails
  in Mixtral's experts (bfloat16 experts, float32 activations);
- a block-wise FP8 scale ([out / 128, in / 128]) is multiplied as if per channel: a shape error;
- INT8 weights stored unpacked (`int-quantized`, kiln's int8-w8a8) match none of the converter's
  sources (it expects `weight_packed`): the fused parameters are reported missing and the load fails;
- the experts are no longer Linears, so compressed-tensors does not fake-quantize their activations
  (a W8A8 bundle's experts run as W8A16).

A bundle's experts are per-expert Linears, each with its scheme, and that is how a serving runtime
reads them (vLLM's compressed-tensors MoE methods quantize the experts' activations as the scheme
says). Here they are loaded that way: `experts_as_linears` builds each fused experts module as a
`LinearExperts` (one Linear per projection per expert, named as the family's record names them, so
the checkpoint's tensors load by name), and drops the family's expert WeightConverters from
transformers' conversion mapping while a model is built and loaded. compressed-tensors then wraps,
loads and decompresses every expert Linear as it does the attention's. `LinearExperts.forward` is
transformers' eager experts loop over those Linears. A plain checkpoint (and a bf16 bundle) keeps
transformers' fused experts and its own conversion.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar, Final

from kiln.core.error_codes import Codes
from kiln.core.errors import StageFailed
from kiln.formats.architectures import ARCHITECTURES
from kiln.formats.architectures.record import Architecture, Projections

# transformers' patch and conversion mappings are process-wide: one model is built under ours at a time.
_LOCK = threading.Lock()
COMPRESSED_TENSORS: Final = "compressed-tensors"  # the quant_method of kiln's quantized bundles


def is_compressed_tensors(config: Any) -> bool:
    """Whether a transformers config's `quantization_config` (config.json's object, or transformers' own config
    class) is compressed-tensors'."""
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return bool(method == COMPRESSED_TENSORS)  # transformers' QuantizationMethod is a str enum


def fused_experts(model: Any) -> dict[str, Any]:
    """The fused experts modules of `model` (built on any device) by path: those holding their experts as
    3-D parameters, as transformers' `use_experts_implementation` classes do."""
    return {
        path: module
        for path, module in model.named_modules()
        if any(p.dim() == 3 for p in module.parameters(recurse=False)) and hasattr(module, "num_experts")
    }


def loading_experts(config: Any) -> AbstractContextManager[None]:
    """How transformers builds and loads `config`'s model: a compressed-tensors bundle of a family with experts
    under `experts_as_linears`, anything else (a plain checkpoint, a release's FP8 block or MXFP4 experts, which
    transformers' own integrations read) as transformers does alone."""
    if not is_compressed_tensors(config):
        return nullcontext()
    record = ARCHITECTURES.get(next(iter(getattr(config, "architectures", None) or []), ""))
    if record is None or record.mlp.experts is None:
        return nullcontext()
    if record.mlp.experts.layout == "fused":  # stacked 3-D experts (gpt-oss), which no scheme quantizes: kept bf16
        return nullcontext()
    return experts_as_linears(config, record)


@contextmanager
def experts_as_linears(config: Any, record: Architecture) -> Iterator[None]:
    """While open, transformers builds the family's fused experts class as `LinearExperts` and loads a
    checkpoint's per-expert tensors into it by name (its expert WeightConverters dropped); both are put
    back on exit."""
    import torch
    import transformers
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.core_model_loading import WeightConverter

    if record.mlp.experts is None:
        raise ValueError(f"{record.family} has no experts")
    with torch.device("meta"):
        probe = transformers.AutoModelForCausalLM.from_config(config)
    fused = fused_experts(probe)
    if not fused:
        raise StageFailed(
            f"transformers builds no fused experts module for {record.hf_class}",
            code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
        )
    classes: set[Any] = {type(m) for m in fused.values()}
    params = {f"{path.rsplit('.', 1)[-1]}.{n}" for path, m in fused.items() for n, _ in m.named_parameters()}
    model_type = config.model_type
    with _LOCK:
        original = get_checkpoint_conversion_mapping(model_type)
        kept = [
            t
            for t in original or []
            if not (isinstance(t, WeightConverter) and any(p.endswith(tuple(params)) for p in t.target_patterns))
        ]
        # transformers' own patching (`monkey_patching.apply_patches`) rebinds the class's name in the module that
        # builds it; done here for that one module, as `apply_patches` visits every transformers module (and so
        # imports optional ones, torchvision's among them).
        patched = [(sys.modules[cls.__module__], cls) for cls in classes]
        for module, cls in patched:
            setattr(module, cls.__name__, linear_experts_class(cls, record.mlp.experts.projections))
        if original is not None:
            register_checkpoint_conversion_mapping(model_type, kept, overwrite=True)
        try:
            yield
        finally:
            for module, cls in patched:
                setattr(module, cls.__name__, cls)
            if original is not None:
                register_checkpoint_conversion_mapping(model_type, original, overwrite=True)


@functools.cache
def linear_experts_class(fused: Any, projections: Projections) -> type[Any]:
    """A `LinearExperts` class standing in for transformers' fused experts class `fused`."""
    return type(fused.__name__ + "AsLinears", (_linear_experts(),), {"fused": fused, "projections": projections})


@functools.cache
def _linear_experts() -> type[Any]:
    """The `LinearExperts` module class (defined on first use: torch is imported only where an eval runs)."""
    import torch

    class LinearExperts(torch.nn.Module):
        """A fused experts module's computation over one Linear per projection per expert.

        Expert e's projections are `<e>.<gate>`, `<e>.<up>` and `<e>.<down>` (the record's names: Mixtral's
        w1, w3, w2), as the checkpoint stores them. The sizes and activation are the fused class's own,
        read from an instance built on the meta device with the same config."""

        fused: ClassVar[type]
        projections: ClassVar[Projections]

        def __init__(self, config: Any) -> None:
            super().__init__()
            with torch.device("meta"):
                like = self.fused(config)
            if getattr(like, "is_transposed", False) or not getattr(like, "has_gate", True):
                raise StageFailed(
                    f"{type(like).__name__}'s experts are not gate/up [2 x intermediate, hidden] then down",
                    code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
                )
            experts, double, hidden = like.gate_up_proj.shape
            bias = bool(getattr(like, "has_bias", False))
            self.num_experts = int(experts)
            self.act_fn = like.act_fn
            p = self.projections
            for e in range(self.num_experts):
                expert = torch.nn.Module()
                expert.add_module(p.gate, torch.nn.Linear(hidden, double // 2, bias=bias))
                expert.add_module(p.up, torch.nn.Linear(hidden, double // 2, bias=bias))
                expert.add_module(p.down, torch.nn.Linear(double // 2, hidden, bias=bias))
                self.add_module(str(e), expert)
            # No parameter of its own to initialise: the family's `_init_weights` would take it for the fused
            # class (whose name it stands in for while a model is built) and initialise 3-D parameters it lacks.
            self._is_hf_initialized = True

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            """transformers' eager experts forward (`Qwen3MoeExperts.forward`): each expert a token routes
            to, in order, on its tokens, weighted and added into the output."""
            p = self.projections
            out = torch.zeros_like(hidden_states)
            with torch.no_grad():
                mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for e in hit[:, 0].tolist():
                top_k_pos, token_idx = torch.where(mask[e])
                expert = self._modules[str(e)]
                x = hidden_states[token_idx]
                h = self.act_fn(getattr(expert, p.gate)(x)) * getattr(expert, p.up)(x)
                h = getattr(expert, p.down)(h) * top_k_weights[token_idx, top_k_pos, None]
                out.index_add_(0, token_idx, h.to(out.dtype))
            return out

    return LinearExperts
