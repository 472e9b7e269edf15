"""Tiny random models of each supported family, written as a release directory would be.

Random weights are enough to check that a converter and a runtime compute the same function;
quality figures come from the trained example model in examples/.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.quant.schemes import HeadChoice

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# The families of 2025-26 the tests build beside the first three, and what each one's tiny model sets beyond the
# shared sizes: experts (Qwen3-MoE: more experts than tokens route to in a short text, so some see none;
# Mixtral: 4 of them, top-2), Gemma 3's sliding and global layers with a window shorter than an eval window.
NEW_FAMILIES = ("qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3")
FAMILY_CONFIG: dict[str, dict[str, object]] = {
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma3": {"sliding_window": 16, "query_pre_attn_scalar": 16},
    # DeepSeek-V3 in miniature: MLA with a query latent, one dense layer then 8 experts top-2 in 2 groups (the best
    # one chosen) beside a shared expert.
    "deepseek_v3": {
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
    },
    # gpt-oss in miniature: 4 experts top-2 of width 32 (a whole MXFP4 block of inputs), a 16-token window.
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16, "head_dim": 16},
}
# Families whose attention has as many KV heads as query heads (MLA expands its latent to every head).
KV_HEADS_ARE_HEADS = ("deepseek_v3",)
CONFIG_CLASSES = {"gemma3": "Gemma3TextConfig"}
HEAD_DIM_DEFAULTS = ("qwen3", "qwen3_moe", "gemma3")
TIED_FAMILIES = ("gemma3",)
# Families whose RMSNorm scales by (1 + w): their norms are drawn around 0, not 1.
OFFSET_NORM_FAMILIES = ("gemma3",)


@functools.cache
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "shlex.py", "heapq.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    return tok.to_str()


def make_model(
    out: Path,
    family: str = "llama",
    *,
    tie_word_embeddings: bool | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    dtype: str = "bfloat16",
    shards: int = 1,
    seed: int = 0,
    **config: object,
) -> Path:
    """Write a random model of `family` with a real BPE tokenizer into `out` and return `out`; `config` sets
    config keys beyond the shared sizes and the family's own (`FAMILY_CONFIG`)."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_tokenizer_json(vocab_size), encoding="utf-8")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(out)
    eot = fast.convert_tokens_to_ids("<|endoftext|>")
    arch = FAMILIES[family]
    config_cls = getattr(transformers, CONFIG_CLASSES.get(family, arch.replace("ForCausalLM", "Config")))
    extra = {**FAMILY_CONFIG.get(family, {}), **config}
    if family == "gemma3" and "layer_types" not in extra:  # one sliding layer, then a global one, repeated
        extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if family in HEAD_DIM_DEFAULTS:  # their configs default to 128 / 256, not hidden / heads
        extra.setdefault("head_dim", hidden_size // num_heads)
    if tie_word_embeddings is None:
        tie_word_embeddings = family in TIED_FAMILIES
    if family in KV_HEADS_ARE_HEADS:
        num_kv_heads = num_heads
    model_config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(model_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # non-trivial norms catch a missing or misplaced norm
                p.uniform_(-0.2, 0.2) if family in OFFSET_NORM_FAMILIES else p.uniform_(0.8, 1.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    model.to(getattr(torch, dtype)).save_pretrained(
        out, safe_serialization=True, max_shard_size=_shard_size(model, shards)
    )
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["architectures"] = [arch]
    config_path.write_text(json.dumps(cfg, indent=2))
    return out


def sharpen(model_dir: Path, strength: float = 1.0) -> None:
    """Peaked next-token distributions, position-dependent attention and decisive routing: a random model predicts
    almost uniformly, which would hide a misplaced norm, a wrong rope or window, or wrong experts behind a tiny KL.
    Scales by role: q and k (through their per-head norms where the family has them), the router, the head (through
    the final norm where it is tied); `strength` scales the head's factor (1: perplexities in the millions, for
    comparing forwards; lower for a model whose quantized artifacts must pass their gates)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kiln.formats.architectures.record import TensorKind
    from kiln.formats.hf_model import open_source

    shape = open_source(model_dir).shape
    offset = shape.arch.norms.offset
    kinds = {t.name: t.kind for t in shape.tensors()}
    # A tied head is also the input embedding: its logits are sharpened through the final norm instead.
    head = TensorKind.OUTPUT_NORM if shape.tie_word_embeddings else TensorKind.OUTPUT
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        kind, x = kinds[name], t.float()
        if kind in (TensorKind.ATTN_Q_NORM, TensorKind.ATTN_K_NORM):
            x = (offset + x) * 4.0 - offset
        elif (kind in (TensorKind.ATTN_Q, TensorKind.ATTN_K) and not shape.arch.attention.qk_norm) or kind in (
            TensorKind.ATTN_Q_B,  # MLA: the query, and the rope key every head shares
            TensorKind.ATTN_KV_A_MQA,
        ):
            x = x * 10.0
        elif kind == TensorKind.ATTN_QKV:  # Phi-3: q and k rows (v's scale only scales the attention output)
            x = x * 6.0
        elif kind == TensorKind.FFN_GATE_INP:
            x = x * 8.0
        elif kind == head:
            x = (offset + x) * 30.0 * strength - offset
        tensors[name] = x.to(torch.bfloat16).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _shard_size(model: object, shards: int) -> str:
    if shards <= 1:
        return "10GB"
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    return f"{max(1, total // shards // 1000)}KB"


def make_bundle(
    source_dir: Path,
    out: Path,
    scheme: str,
    target: str = "hf-bundle",
    params: dict[str, str] | None = None,
    *,
    lm_head: HeadChoice = "kept",
    samples: int = 4,
    seq_len: int = 64,
) -> Path:
    """`scheme`'s hf-bundle (or rocm-bundle) of the model in `source_dir`, in `out/bundle`: round-to-nearest, or
    llm-compressor's (FP4; GPTQ/AWQ and NVFP4's activation scales calibrated on `samples` windows of `seq_len`
    tokens of the stdlib's `argparse.py`); `lm_head` kept in bf16 or quantized (`quant.catalog.get_scheme`)."""
    import sysconfig

    from kiln.formats.hf_model import open_source
    from kiln.quant.calibrated import calibrate, calibration_dtype, calibration_samples
    from kiln.quant.catalog import get_scheme
    from kiln.quant.store import open_quantized, write_quantized
    from kiln.targets.base import ExportRequest
    from kiln.targets.hf_bundle.export import export as hf_export
    from kiln.targets.rocm_bundle.export import export as rocm_export

    source = open_source(source_dir)
    quantized = None
    method = get_scheme(scheme, lm_head)
    if method.quantized:
        (out / "q").mkdir(parents=True)
        calibrated = None
        if method.by_llmcompressor:
            text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
            windows = (
                calibration_samples(source_dir, text, samples=samples, seq_len=seq_len) if method.calibrated else []
            )
            calibrated = calibrate(source, method, windows, offload_dir=out, compute_dtype=calibration_dtype())
        write_quantized(source, method, out / "q", calibrated=calibrated)
        quantized = open_quantized(out / "q", scheme)
    bundle = out / "bundle"
    bundle.mkdir(parents=True)
    export = hf_export if target == "hf-bundle" else rocm_export
    export(source, ExportRequest(quant=scheme, out_dir=bundle, params=params or {}, quantized=quantized))
    return bundle
