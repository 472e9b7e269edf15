"""Tiny pre-quantized releases, written as their publishers write them, from a random bf16 tiny model.

- `make_fp8_block_source`: a Llama (or Qwen3) whose decoder Linears are FP8 e4m3 with 128 x 128 block scales, as
  DeepSeek-V3 and Qwen3's "-FP8" releases store them (`formats.prequantized`, FP8 block). Its default sizes put
  q/o projections on whole blocks and k/v, gate/up and down on blocks that overhang the matrix (64 and 320
  rows or columns), which DeepSeek pads with zeros.
- `make_mxfp4_source`: a gpt-oss whose experts are MXFP4 `*_blocks` / `*_scales`, the rest bf16, as openai's
  release stores them.

The quantizers here are the layouts' own rules, written independently of kiln's decoders so that a round trip
tests both: FP8 block is DeepSeek's `weight_quant_kernel` (deepseek-ai/DeepSeek-V3 `inference/kernel.py`:
s = amax / 448 over the zero-padded block, values x / s cast to e4m3; an all-zero block gets scale 1 as
transformers' `Fp8Quantize` gives it, where DeepSeek's would divide by zero); MXFP4 is the OCP MX v1.0 rule
(shared exponent floor(log2(amax)) - 2, E2M1's largest exponent; each value / 2^exponent rounded to the nearest
E2M1, ties to even, saturating at 6; an all-zero block gets exponent byte 0, as ggml's quantize_row_mxfp4_ref).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# openai/gpt-oss-20b and -120b config.json, as released.
MXFP4_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
# Midpoints between consecutive E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); at a tie the even code wins.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight as (float8_e4m3fn values, weight_scale_inv [ceil(rows/br), ceil(cols/bc)]); the values are
    divided by the scale as stored (rounded to `scale_dtype`, float32 by default), so fp8 x scale is the weight."""
    import torch

    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(nr, br, nc, bc)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).to(scale_dtype or torch.float32)
    q = (tiles / scale.float()[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] (cols a multiple of 32) as (blocks uint8 [..., rows, cols/32, 16], scales uint8
    [..., rows, cols/32]): value 2k of a block in byte k's low nibble, 2k + 1 in its high nibble."""
    import torch

    *lead, rows, cols = w.shape
    x = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = x.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    scaled = (x / torch.exp2(exp)[..., None]).abs()
    code = torch.zeros_like(scaled, dtype=torch.uint8)
    for k, mid in enumerate(_E2M1_MIDPOINTS):
        code += (scaled > mid if k % 2 == 0 else scaled >= mid).to(torch.uint8)
    code |= (x < 0).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def make_fp8_block_source(
    out: Path,
    family: str = "llama",
    *,
    scale_dtype: str = "float32",
    block: tuple[int, int] = (128, 128),
    hidden_size: int = 128,
    intermediate_size: int = 320,
    quantization_config: dict[str, Any] | None = None,
    **config: Any,
) -> Path:
    """A tiny `family` model whose decoder-layer Linears are FP8 block, with `weight_scale_inv` in `scale_dtype`
    (DeepSeek's float32, Qwen3's bfloat16), and config.json's `quantization_config` (FP8_CONFIG by default)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kiln.formats.architectures import LINEAR_WEIGHT
    from tests.model_factory import make_model

    make_model(out, family, hidden_size=hidden_size, intermediate_size=intermediate_size, **config)
    path = out / "model.safetensors"
    tensors = load_file(path)
    stored: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if LINEAR_WEIGHT.match(name):
            q, s = quantize_fp8_block(t, block, getattr(torch, scale_dtype))
            stored[name], stored[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
        else:
            stored[name] = t
    save_file(stored, path, metadata={"format": "pt"})
    _set_quantization(out, quantization_config or {**FP8_CONFIG, "weight_block_size": list(block)})
    return out


def make_mxfp4_source(
    out: Path, *, experts: int = 4, hidden_size: int = 64, intermediate_size: int = 64, head_dim: int = 16
) -> Path:
    """A tiny gpt-oss (transformers' GptOssForCausalLM, random, bf16) with its experts stored MXFP4 as released:
    `gate_up_proj` [E, hidden, 2I] as `gate_up_proj_blocks` [E, 2I, hidden/32, 16] and `_scales`, `down_proj`
    [E, I, hidden] as `down_proj_blocks` [E, hidden, I/32, 16]: each the transpose of the held matrix, blocked
    along its input dimension."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from tests.model_factory import _tokenizer_json

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_tokenizer_json(512), encoding="utf-8")
    config = transformers.GptOssConfig(
        vocab_size=512,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_local_experts=experts,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072,  # gpt-oss's: YaRN's 4,096 original positions x 32
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    stored: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.to(torch.bfloat16).transpose(1, 2))
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
        else:
            stored[name] = t.to(torch.bfloat16).contiguous()
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = ["GptOssForCausalLM"]  # as released, so its architecture record reads it
    model.config.save_pretrained(out)
    _set_quantization(out, MXFP4_CONFIG)
    return out


def _set_quantization(out: Path, quantization_config: dict[str, Any]) -> None:
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config
    path.write_text(json.dumps(config, indent=2))
