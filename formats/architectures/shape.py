"""A model's shape as one checked config.json gives it (`ModelShape`), and every tensor it implies.

`ModelShape.from_config` finds the family's record (`formats.architectures.ARCHITECTURES`), validates the
config with the record's strict schema and reads what every stage needs from it; `tensors()` lists every
weight the checkpoint must hold (name, shape, kind, layer, expert), built from the record's building blocks
(`layer_tensors`), in the canonical order: the embedding, the final norm, the head, then each layer.
`record()` is what crosses the wire (`core.shape.ShapeRecord`): what sizing (`placement`) and the registry
read of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import ValidationError

from kiln.core.errors import SourceInvalid
from kiln.core.shape import ShapeRecord
from kiln.core.untrusted import short_repr
from kiln.formats.architectures import FAMILIES, get_architecture
from kiln.formats.architectures.config import FamilyConfig, MlaShape, MoeShape, RopeSpec
from kiln.formats.architectures.record import LINEAR_KINDS, Architecture, LayerType, TensorKind, TensorSpec
from kiln.formats.prequantized import SourceQuantization


def _config_error(e: ValidationError) -> SourceInvalid:
    problems = []
    for err in e.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "config"
        if err["type"] == "missing":
            problems.append((loc, "is required"))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        problems.append((loc, f"{msg}, got {short_repr(err['input'])}"))
    return SourceInvalid(
        "config.json: " + "; ".join(f"{loc}: {msg}" for loc, msg in problems),
        details={
            "file": "config.json",
            "field": problems[0][0],
            "errors": [{"field": f, "message": m} for f, m in problems],
        },
    )


def _invalid(field: str, message: str) -> SourceInvalid:
    return SourceInvalid(f"config.json: {message}", details={"file": "config.json", "field": field})


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a release's checkpoint stores it (`ModelShape.stored_tensors`): its name, SafeTensors dtype
    (None: the source's own float type, config.json's `torch_dtype`) and shape, and the weight it holds or scales."""

    name: str
    dtype: str | None
    shape: tuple[int, ...]
    of: TensorSpec


@dataclass(frozen=True)
class MergedGemm:
    """Linears of one layer that vLLM and TensorRT-LLM run as one GEMM, their outputs stacked in `parts` order
    (each part's name in the layer and its output rows): vLLM's packed modules `qkv_proj`, `gate_up_proj` and
    `fused_qkv_a_proj`, and a fused MoE's gate and up projections (`w13`). A scale that covers blocks of rows
    covers the stacked rows, so every part but the last must fill whole blocks (vllm 0.32.0
    `validate_fp8_block_shape`; TensorRT-LLM concatenates the parts' block scales the same way)."""

    name: str
    parts: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ModelShape:
    """The hyper-parameters every target needs, read once from config.json through the family's record."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float  # the full-attention layers' rope base (the sliding layers' where every layer slides)
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    hidden_act: str = "silu"
    layer_types: tuple[LayerType, ...] = ()  # one per layer; () means every layer is full attention
    sliding_window: int | None = None
    moe: MoeShape | None = None
    rope: tuple[tuple[LayerType, RopeSpec], ...] = ()
    rotary_fraction: float = 1.0
    query_pre_attn_scalar: float | None = None  # attention scaled by its ^-1/2 (else head_dim's)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    mla: MlaShape | None = None  # multi-head latent attention's sizes (head_dim is then each query's and key's)
    swiglu_limit: float | None = None  # the clamped SwiGLU's limit (gpt-oss)
    prediction_layers: int = 0  # multi-token-prediction layers a checkpoint may carry (`extra_tensors`)
    # How the release stores its weights: config.json's `quantization_config` as `formats.prequantized` reads it.
    source_quant: SourceQuantization | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        arch = get_architecture(config.get("architectures"))
        try:
            c = arch.config.model_validate(config)
        except ValidationError as e:
            raise _config_error(e) from None
        return cls.from_family_config(arch, c)

    @classmethod
    def from_family_config(cls, arch: Architecture, c: FamilyConfig) -> ModelShape:
        heads = c.num_attention_heads
        kv_heads = c.num_key_value_heads if c.num_key_value_heads is not None else heads
        mla = c.mla()
        if mla is not None:  # every head's query and key: its no-rope and rope parts
            head_dim = mla.qk_head_dim
        elif c.head_dim is not None:
            head_dim = c.head_dim
        elif c.hidden_size % heads == 0:
            head_dim = c.hidden_size // heads
        else:
            raise _invalid(
                "head_dim",
                f"head_dim is absent and hidden_size={c.hidden_size} is not a multiple of num_attention_heads={heads}",
            )
        if heads % kv_heads:
            raise _invalid(
                "num_key_value_heads",
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
            )
        if head_dim % 2:
            raise _invalid("head_dim", f"head_dim={head_dim} must be even for rotary embeddings")
        activation = c.activation()
        if activation not in arch.mlp.activations:
            raise _invalid(
                arch.config.activation_key,
                f"{arch.config.activation_key}={activation!r} is not what {arch.hf_class} computes with; "
                f"kiln reads {', '.join(arch.mlp.activations)}",
            )
        kinds = c.layer_kinds()
        window = c.window()
        if "sliding_attention" in kinds and window is None:
            raise _invalid("sliding_window", "layer_types has sliding layers but sliding_window is null")
        rope = c.rope()
        main = rope.get("full_attention") or next(iter(rope.values()))
        eos = c.eos_token_id
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        moe = c.moe()
        if (moe is not None) != arch.is_moe:
            raise _invalid("architectures", f"{arch.hf_class}'s record and its config disagree on experts")
        return cls(
            architecture=arch.hf_class,
            family=arch.family,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=main.theta,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings if c.tie_word_embeddings is not None else arch.tied_default,
            attention_bias=c.attention_bias if c.attention_bias is not None else arch.attention.bias,
            bos_token_id=c.bos_token_id,
            eos_token_id=eos,
            hidden_act=activation,
            layer_types=kinds if "sliding_attention" in kinds else (),
            sliding_window=window,
            moe=moe,
            rope=tuple(sorted(rope.items())),
            rotary_fraction=c.rotary_fraction(),
            query_pre_attn_scalar=getattr(c, "query_pre_attn_scalar", None),
            attn_logit_softcapping=getattr(c, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(c, "final_logit_softcapping", None),
            mla=mla,
            swiglu_limit=getattr(c, "swiglu_limit", None),
            prediction_layers=c.prediction_layers() if arch.prediction_layers is not None else 0,
            source_quant=c.quantization_config,
        )

    # -- the record and what it derives ----------------------------------------------------------------------

    @property
    def arch(self) -> Architecture:
        return FAMILIES[self.family]

    def layer_type(self, layer: int) -> LayerType:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def rope_for(self, layer_type: LayerType) -> RopeSpec:
        return dict(self.rope)[layer_type] if self.rope else RopeSpec(self.rope_theta)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (False: a dense MLP)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def merged_gemms(self) -> tuple[MergedGemm, ...]:
        """The Linears a serving runtime merges into one GEMM, once for each kind of layer this model has: the
        attention's q, k and v (MLA: the query's and the key-value latent's down-projections), a dense layer's
        gate and up, a sparse layer's experts' gate and up and its shared expert's (`MergedGemm`)."""
        arch, a = self.arch, f"{self.arch.attention.prefix}."
        out: list[MergedGemm] = []
        if self.mla is None:
            qkv = ((a + "q_proj", self.q_size), (a + "k_proj", self.kv_size), (a + "v_proj", self.kv_size))
            out.append(MergedGemm(a + "qkv_proj", qkv))
        elif self.mla.q_lora_rank is not None:
            parts = ((a + "q_a_proj", self.mla.q_lora_rank), (a + "kv_a_proj_with_mqa", self.mla.cache_width))
            out.append(MergedGemm(a + "fused_qkv_a_proj", parts))
        m, proj = f"{arch.mlp.prefix}.", arch.mlp.projections
        moe, experts = self.moe, arch.mlp.experts
        if moe is None or len(moe.sparse_layers) < self.num_layers:
            ff = self.intermediate_size
            out.append(MergedGemm(m + "gate_up_proj", ((m + proj.gate, ff), (m + proj.up, ff))))
        if moe is not None and experts is not None and moe.sparse_layers:
            b, ep = f"{experts.block}.{experts.experts}.", experts.projections
            ff = moe.intermediate_size
            out.append(MergedGemm(b + "w13", ((f"{b}<e>.{ep.gate}", ff), (f"{b}<e>.{ep.up}", ff))))
            if experts.shared is not None and moe.shared_intermediate_size:
                s, sff = f"{experts.block}.{experts.shared}.", moe.shared_intermediate_size
                out.append(MergedGemm(s + "gate_up_proj", ((s + "gate_proj", sff), (s + "up_proj", sff))))
        return tuple(out)

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        """Every tensor of decoder layer `layer`, in the family's canonical order."""
        return layer_tensors(self, layer)

    def tensors(self) -> list[TensorSpec]:
        """Every weight tensor the checkpoint must contain: the embedding, final norm, head, then each layer."""
        return list(self._tensors)

    @cached_property
    def _tensors(self) -> tuple[TensorSpec, ...]:
        """`tensors()`, built once: a plan sizes its stages from them many times, and a mixture of experts has
        ~10^5 of them (DeepSeek-V3: 45,395)."""
        h, v = self.hidden_size, self.vocab_size
        out = [
            TensorSpec("model.embed_tokens.weight", (v, h), TensorKind.TOKEN_EMBD),
            TensorSpec("model.norm.weight", (h,), TensorKind.OUTPUT_NORM),
        ]
        if not self.tie_word_embeddings:
            out.append(TensorSpec("lm_head.weight", (v, h), TensorKind.OUTPUT))
        for i in range(self.num_layers):
            out += layer_tensors(self, i)
        return tuple(out)

    @cached_property
    def _layer_counts(self) -> tuple[int, int]:
        """(tensors of a dense layer, of a sparse layer)."""
        dense = next((i for i in range(self.num_layers) if not self.is_sparse(i)), None)
        sparse = self.moe.sparse_layers[0] if self.moe is not None and self.moe.sparse_layers else None
        return (
            len(layer_tensors(self, dense)) if dense is not None else 0,
            len(layer_tensors(self, sparse)) if sparse is not None else 0,
        )

    @property
    def tensor_count(self) -> int:
        """How many tensors `tensors()` lists, computed without building it (one layer of each kind is)."""
        sparse_layers = len(self.moe.sparse_layers) if self.moe is not None else 0
        dense, sparse = self._layer_counts
        head = 2 + (0 if self.tie_word_embeddings else 1)
        return head + (self.num_layers - sparse_layers) * dense + sparse_layers * sparse

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every weight tensor name the checkpoint must contain, with its shape."""
        return {t.name: t.shape for t in self.tensors()}

    def extra_tensors(self) -> list[TensorSpec]:
        """The tensors a release's checkpoint may carry beyond `tensors()`, which kiln recognises and builds nothing
        from (the record's `prediction_layers`, and why): each multi-token-prediction layer after the decoder's, a
        decoder layer with experts and its own embedding, norms, projection and head. Empty for other families."""
        out: list[TensorSpec] = []
        h, v = self.hidden_size, self.vocab_size
        for i in range(self.num_layers, self.num_layers + self.prediction_layers):
            p = f"model.layers.{i}."
            out += [
                TensorSpec(p + "embed_tokens.weight", (v, h), TensorKind.NEXTN_EMBED_TOKENS, layer=i),
                TensorSpec(p + "enorm.weight", (h,), TensorKind.NEXTN_ENORM, layer=i),
                TensorSpec(p + "hnorm.weight", (h,), TensorKind.NEXTN_HNORM, layer=i),
                TensorSpec(p + "eh_proj.weight", (h, 2 * h), TensorKind.NEXTN_EH_PROJ, layer=i),
                TensorSpec(p + "shared_head.norm.weight", (h,), TensorKind.NEXTN_SHARED_HEAD_NORM, layer=i),
                TensorSpec(p + "shared_head.head.weight", (v, h), TensorKind.NEXTN_SHARED_HEAD_HEAD, layer=i),
            ]
            out += layer_tensors(self, i, sparse=True)
        return out

    def stored_tensors(self, *, extras: bool = False) -> Iterator[StoredTensor]:
        """Every tensor of `tensors()` (and `extra_tensors()` with `extras`) as the release stores it
        (`source_quant`, config.json's `quantization_config`): each one its layout quantizes (`stores_quantized`) as
        the layout's values and scales (`SourceQuantization.stored`: FP8 block-scaled Linears as the weight in
        F8_E4M3 and its float32 `weight_scale_inv` [rows / block, columns / block, rounded up]; MXFP4 experts as
        `<name>_blocks` [experts, rows, columns / 32, 16] and `<name>_scales` [experts, rows, columns / 32], uint8,
        rows the outputs: a stacked `[experts, in, out]` tensor's last axis), by the rules `plan_quantized` checks
        a release's headers by; everything else as `tensors()` names it, in the source's own float type (`dtype`
        None)."""
        q = self.source_quant
        for t in [*self.tensors(), *(self.extra_tensors() if extras else [])]:
            if q is None or not stores_quantized(q, t):
                yield StoredTensor(t.name, None, t.shape, t)
                continue
            for part in q.stored(t.name, t.shape):
                yield StoredTensor(part.name, part.dtype, part.shape, t)

    def record(self) -> ShapeRecord:
        """What the registry keeps about the model (a release's `model_config`): sizing (`placement`) reads KV
        caches, tensor-parallel degrees, parameters total and active and prefill FLOPs from it."""
        moe = self.moe
        return ShapeRecord(
            architecture=self.architecture,
            num_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            num_experts=moe.experts if moe else None,
            experts_per_token=moe.experts_per_token if moe else None,
            moe_intermediate_size=moe.intermediate_size if moe else None,
            shared_expert_intermediate_size=(moe.shared_intermediate_size or None) if moe else None,
            sparse_layers=len(moe.sparse_layers) if moe else None,
            sliding_window=self.sliding_window,
            sliding_layers=sum(t == "sliding_attention" for t in self.layer_types) or None,
            q_lora_rank=self.mla.q_lora_rank if self.mla else None,
            kv_lora_rank=self.mla.kv_lora_rank if self.mla else None,
            qk_rope_head_dim=self.mla.qk_rope_head_dim if self.mla else None,
            v_head_dim=self.mla.v_head_dim if self.mla else None,
        )


def stores_quantized(q: SourceQuantization, t: TensorSpec) -> bool:
    """Whether a release in `q`'s layout stores `t` quantized: a Linear's weight (never a bias, norm, embedding,
    router or head) of the layout's rank (FP8 block: a 2-D Linear; MXFP4: a stack of every expert's), in a module
    `modules_to_not_convert` does not keep."""
    layout = q.layout
    return (
        t.kind in LINEAR_KINDS
        and not t.bias
        and len(t.shape) == layout.released_ndim
        and t.name.endswith(layout.released_suffix)
        and not q.keeps_unquantized(layout.module(t.name))
    )


def layer_tensors(shape: ModelShape, i: int, *, sparse: bool | None = None) -> list[TensorSpec]:
    """Decoder layer `i`'s tensors from the record's building blocks: the norms, attention (separate or fused
    q/k/v, biases, q/k norms, sinks; or MLA's latent projections), then a dense MLP (separate or fused gate/up) or
    a mixture of experts (router, every expert's three Linears or the stacked experts, a shared expert). `sparse`:
    the layer has experts whatever the config's sparse layers say (a multi-token-prediction layer's)."""
    arch = shape.arch
    h, q, kv, hd = shape.hidden_size, shape.q_size, shape.kv_size, shape.head_dim
    p = f"model.layers.{i}."
    out: list[TensorSpec] = []

    def add(
        name: str, dims: tuple[int, ...], kind: TensorKind, *, expert: int | None = None, bias: bool = False
    ) -> None:
        out.append(TensorSpec(p + name, dims, kind, layer=i, expert=expert, bias=bias))

    add("input_layernorm.weight", (h,), TensorKind.ATTN_NORM)
    if arch.norms.sandwich:
        add("post_attention_layernorm.weight", (h,), TensorKind.ATTN_POST_NORM)
        add("pre_feedforward_layernorm.weight", (h,), TensorKind.FFN_NORM)
        add("post_feedforward_layernorm.weight", (h,), TensorKind.FFN_POST_NORM)
    else:
        add("post_attention_layernorm.weight", (h,), TensorKind.FFN_NORM)
    a = f"{arch.attention.prefix}."
    if shape.mla is not None:
        _mla_tensors(shape, shape.mla, a, add)
    elif arch.attention.fused_qkv:
        add(a + "qkv_proj.weight", (q + 2 * kv, h), TensorKind.ATTN_QKV)
    else:
        add(a + "q_proj.weight", (q, h), TensorKind.ATTN_Q)
        add(a + "k_proj.weight", (kv, h), TensorKind.ATTN_K)
        add(a + "v_proj.weight", (kv, h), TensorKind.ATTN_V)
    if shape.mla is None:
        add(a + "o_proj.weight", (h, q), TensorKind.ATTN_OUTPUT)
    if shape.attention_bias and shape.mla is None:
        if arch.attention.fused_qkv:
            add(a + "qkv_proj.bias", (q + 2 * kv,), TensorKind.ATTN_QKV, bias=True)
        else:
            add(a + "q_proj.bias", (q,), TensorKind.ATTN_Q, bias=True)
            add(a + "k_proj.bias", (kv,), TensorKind.ATTN_K, bias=True)
            add(a + "v_proj.bias", (kv,), TensorKind.ATTN_V, bias=True)
        if arch.attention.output_bias:
            add(a + "o_proj.bias", (h,), TensorKind.ATTN_OUTPUT, bias=True)
    if arch.attention.qk_norm:
        add(a + "q_norm.weight", (hd,), TensorKind.ATTN_Q_NORM)
        add(a + "k_norm.weight", (hd,), TensorKind.ATTN_K_NORM)
    if arch.attention.sinks:
        add(a + "sinks", (shape.num_heads,), TensorKind.ATTN_SINKS)
    experts = arch.mlp.experts
    if shape.moe is not None and experts is not None and (shape.is_sparse(i) if sparse is None else sparse):
        moe, b = shape.moe, f"{experts.block}."
        proj, ff, e_count = experts.projections, moe.intermediate_size, moe.experts
        r = f"{b}{experts.router}."
        add(r + "weight", (e_count, h), TensorKind.FFN_GATE_INP)
        if experts.router_bias:
            add(r + "bias", (e_count,), TensorKind.FFN_GATE_INP, bias=True)
        if experts.score_correction_bias:
            add(r + "e_score_correction_bias", (e_count,), TensorKind.FFN_EXP_PROBS_B)
        x = f"{b}{experts.experts}."
        if experts.layout == "fused":  # every expert in one tensor per projection, inputs first
            add(x + "gate_up_proj", (e_count, h, 2 * ff), TensorKind.FFN_GATE_UP_EXPS)
            if experts.bias:
                add(x + "gate_up_proj_bias", (e_count, 2 * ff), TensorKind.FFN_GATE_UP_EXPS, bias=True)
            add(x + "down_proj", (e_count, ff, h), TensorKind.FFN_DOWN_EXPS)
            if experts.bias:
                add(x + "down_proj_bias", (e_count, h), TensorKind.FFN_DOWN_EXPS, bias=True)
        else:
            for e in range(e_count):
                add(f"{x}{e}.{proj.gate}.weight", (ff, h), TensorKind.FFN_GATE_EXPS, expert=e)
                add(f"{x}{e}.{proj.up}.weight", (ff, h), TensorKind.FFN_UP_EXPS, expert=e)
                add(f"{x}{e}.{proj.down}.weight", (h, ff), TensorKind.FFN_DOWN_EXPS, expert=e)
        if experts.shared is not None and moe.shared_intermediate_size:
            s, sff = f"{b}{experts.shared}.", moe.shared_intermediate_size
            add(s + "gate_proj.weight", (sff, h), TensorKind.FFN_GATE_SHEXP)
            add(s + "up_proj.weight", (sff, h), TensorKind.FFN_UP_SHEXP)
            add(s + "down_proj.weight", (h, sff), TensorKind.FFN_DOWN_SHEXP)
            if experts.shared_gate is not None:
                add(b + f"{experts.shared_gate}.weight", (1, h), TensorKind.FFN_GATE_INP_SHEXP)
        return out
    m, proj, ff = f"{arch.mlp.prefix}.", arch.mlp.projections, shape.intermediate_size
    if arch.mlp.fused_gate_up:
        add(m + "gate_up_proj.weight", (2 * ff, h), TensorKind.FFN_GATE_UP)
    else:
        add(m + f"{proj.gate}.weight", (ff, h), TensorKind.FFN_GATE)
        add(m + f"{proj.up}.weight", (ff, h), TensorKind.FFN_UP)
    add(m + f"{proj.down}.weight", (h, ff), TensorKind.FFN_DOWN)
    return out


def _mla_tensors(shape: ModelShape, mla: MlaShape, a: str, add: Callable[..., None]) -> None:
    """Multi-head latent attention's tensors, as transformers' DeepseekV3Attention names them (the record's
    `Attention` "mla"): the query through its latent (or one q_proj), the compressed key-value latent with the shared
    rope key, its norm and up-projection, the output projection; biases on q_a, kv_a and o where `attention_bias`."""
    h, heads = shape.hidden_size, shape.num_heads
    if mla.q_lora_rank is None:
        add(a + "q_proj.weight", (heads * mla.qk_head_dim, h), TensorKind.ATTN_Q)
    else:
        add(a + "q_a_proj.weight", (mla.q_lora_rank, h), TensorKind.ATTN_Q_A)
        if shape.attention_bias:
            add(a + "q_a_proj.bias", (mla.q_lora_rank,), TensorKind.ATTN_Q_A, bias=True)
        add(a + "q_a_layernorm.weight", (mla.q_lora_rank,), TensorKind.ATTN_Q_A_NORM)
        add(a + "q_b_proj.weight", (heads * mla.qk_head_dim, mla.q_lora_rank), TensorKind.ATTN_Q_B)
    add(a + "kv_a_proj_with_mqa.weight", (mla.cache_width, h), TensorKind.ATTN_KV_A_MQA)
    if shape.attention_bias:
        add(a + "kv_a_proj_with_mqa.bias", (mla.cache_width,), TensorKind.ATTN_KV_A_MQA, bias=True)
    add(a + "kv_a_layernorm.weight", (mla.kv_lora_rank,), TensorKind.ATTN_KV_A_NORM)
    add(
        a + "kv_b_proj.weight",
        (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        TensorKind.ATTN_KV_B,
    )
    add(a + "o_proj.weight", (h, heads * mla.v_head_dim), TensorKind.ATTN_OUTPUT)
    if shape.attention_bias:
        add(a + "o_proj.bias", (h,), TensorKind.ATTN_OUTPUT, bias=True)
