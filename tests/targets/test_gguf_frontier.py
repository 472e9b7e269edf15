"""GGUF for DeepSeek-V3 (llama.cpp's `deepseek2`) and gpt-oss (`gpt-oss`), checked against llama.cpp itself.

On tiny random models made by transformers 5.17's DeepseekV3ForCausalLM and GptOssForCausalLM (bf16), and on
tiny releases in their published formats (`tests/quantized_sources.py`: DeepSeek's FP8 E4M3 with 128 x 128 block
scales, gpt-oss's MXFP4 experts):
- llama.cpp's own converter (`convert_hf_to_gguf.py` of the pinned llama-cpp-python 0.3.36's sdist, whose
  `conversion/deepseek.py` DeepseekV2Model splits kv_b into attn_k_b / attn_v_b and skips the prediction layer,
  and `conversion/gpt_oss.py` GptOssModel splits gate_up and repacks MXFP4; its vocabulary step skipped) and kiln
  write the same tensors (names, shapes, types, bytes: F16, BF16, Q8_0 and MXFP4 alike) and the same metadata,
  apart from general.type and general.alignment (`DIFFERENCES`);
- a release's MXFP4 experts are its own blocks and exponents, moved into ggml's layout, never recomputed;
- llama.cpp 0.3.36 loads kiln's files in every GGUF type and its logits agree with transformers' (fp32, the same
  weights; a release's dequantized): F16 to KL <= 1e-6. gpt-oss as transformers configures it (YaRN with
  `truncate: false`) differs from llama.cpp's rope, which rounds YaRN's correction range out to whole dimensions:
  the file agrees with transformers computing that rounding (`test_gpt_oss_yarn_is_llama_cpps`);
- what llama.cpp's graphs compute differently is refused before anything is written (GGUF_UNSUPPORTED).
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kiln.core.errors import InvalidInput
from kiln.eval.metrics import kl_divergence, log_softmax
from kiln.eval.runtimes.llama_cpp_runtime import LlamaCppRuntime
from kiln.formats.architectures.record import TensorKind
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.gguf.constants import QUANTS
from kiln.formats.hf_model import open_source
from kiln.formats.prequantized import FP4_VALUES
from kiln.placement.weights import gguf_bytes
from kiln.targets.base import ExportRequest, ExportResult, get_target
from kiln.targets.gguf.convert import plan_tensors
from kiln.targets.gguf.export import check_supported, export
from tests.llama_cpp_converter import convert, gguf_fields, gguf_tensors, vendored_llama_cpp
from tests.model_factory import make_model
from tests.quantized_sources import make_fp8_block_source, make_mxfp4_source

# Rows of 32 and more (whole Q8_0 blocks everywhere, attn_k_b's and attn_v_b's included): DeepSeek's latents of 64
# and 32, each head's 32 + 16 query and key, 8 experts of 64 in 2 groups beside a shared one and a dense first
# layer; the config says `scoring_func: sigmoid`, as DeepSeek-V3's release does.
DEEPSEEK: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    moe_intermediate_size=64,
    scoring_func="sigmoid",
)
GPT_OSS: dict[str, Any] = dict(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2)
MODELS = ("deepseek_v3", "gpt_oss", "deepseek_fp8", "gpt_oss_mxfp4", "deepseek_mtp", "deepseek_yarn")
# DeepSeek-V3's YaRN as released (factor 40 over 4,096 positions, mscale = mscale_all_dim = 1), scaled to the tiny
# model's 512 positions: transformers then scales the softmax by (0.1 ln 4 + 1)^2, llama.cpp by its yarn_log_multiplier.
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}
ARCH = {m: "deepseek2" if m.startswith("deepseek") else "gpt-oss" for m in MODELS}
# What the converter writes each model as, to compare kiln's file of the same quant with.
CONVERTED: list[tuple[str, str]] = [
    ("deepseek_v3", "f16"),
    ("deepseek_v3", "q8_0"),
    ("gpt_oss", "f16"),
    ("gpt_oss", "q8_0"),
    ("deepseek_fp8", "f16"),
    ("deepseek_fp8", "q8_0"),
    ("gpt_oss_mxfp4", "bf16"),
    ("gpt_oss_mxfp4", "f16"),
    ("gpt_oss_mxfp4", "q8_0"),
    ("deepseek_mtp", "bf16"),
    ("deepseek_yarn", "f16"),
]
# Metadata keys the two files may differ in, and why.
DIFFERENCES = {
    "general.type": "the converter says 'model'; llama.cpp reads general.type only to refuse a LoRA adapter loaded as "
    "a model",
    "general.alignment": "kiln writes the default alignment (32) explicitly; the converter leaves it implicit",
}

TEXT = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")[2000:2500]


def _sharpen(model_dir: Path) -> None:
    """Attention far from uniform, so a wrong rope, window, latent split or sink shows in the logits: the query and
    key projections scaled by 4 (MLA's: the query's up-projection, the latent with its rope key, the latent's
    up-projection), the router by 4, so a token's choice of experts is decisive, and gpt-oss's sinks drawn in
    [0, 2], so each takes a real share of its row's attention."""
    from safetensors.torch import load_file, save_file

    shape = open_source(model_dir).shape
    specs = {t.name: t for t in shape.tensors()}
    sharpened = {
        TensorKind.ATTN_Q,
        TensorKind.ATTN_K,
        TensorKind.ATTN_Q_B,
        TensorKind.ATTN_KV_A_MQA,
        TensorKind.ATTN_KV_B,
        TensorKind.FFN_GATE_INP,
    }
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        spec = specs[name]
        if spec.bias:
            continue
        if spec.kind in sharpened:
            tensors[name] = (t.float() * 4).to(t.dtype)
        elif spec.kind is TensorKind.ATTN_SINKS:
            tensors[name] = (torch.rand(t.shape, generator=generator) * 2).to(t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def _with_prediction_layer(src: Path, out: Path) -> Path:
    """A copy of the model in `src` whose checkpoint also carries DeepSeek's multi-token-prediction layer after its
    decoder layers (random values), as the release does: kiln's ingest recognises it and builds nothing from it,
    and the converter skips it (`skip_mtp`)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    extra = open_source(src).shape.extra_tensors()
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(2)
    tensors |= {t.name: torch.randn(t.shape, generator=generator).to(torch.bfloat16) for t in extra}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _released(out: Path) -> Path:
    """gpt-oss's MXFP4 release in miniature, with the `architectures` its config.json names."""
    make_mxfp4_source(out)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": ["GptOssForCausalLM"]}, indent=2))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("frontier")
    out = {
        "deepseek_v3": make_model(root / "deepseek_v3", "deepseek_v3", **DEEPSEEK),
        "gpt_oss": make_model(root / "gpt_oss", "gpt_oss", **GPT_OSS),
        "deepseek_fp8": make_fp8_block_source(root / "deepseek_fp8", "deepseek_v3", scoring_func="sigmoid"),
        "gpt_oss_mxfp4": _released(root / "gpt_oss_mxfp4"),
    }
    _sharpen(out["deepseek_v3"])
    _sharpen(out["gpt_oss"])
    out["deepseek_mtp"] = _with_prediction_layer(out["deepseek_v3"], root / "deepseek_mtp")
    out["deepseek_yarn"] = shutil.copytree(out["deepseek_v3"], root / "deepseek_yarn")
    config = json.loads((out["deepseek_yarn"] / "config.json").read_text())
    (out["deepseek_yarn"] / "config.json").write_text(json.dumps({**config, "rope_parameters": DEEPSEEK_YARN}))
    return out


@pytest.fixture(scope="module")
def exported(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], tuple[Path, ExportResult]]:
    root = tmp_path_factory.mktemp("frontier-out")
    cache: dict[tuple[str, str], tuple[Path, ExportResult]] = {}

    def get(model: str, quant: str) -> tuple[Path, ExportResult]:
        if (model, quant) not in cache:
            out = root / f"{model}-{quant}"
            res = export(open_source(models[model]), ExportRequest(quant=quant, out_dir=out, params={"name": "tiny"}))
            cache[model, quant] = (out / res.files[0], res)
        return cache[model, quant]

    return get


@pytest.fixture(scope="module")
def converted(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """llama.cpp's converter's file of each (model, quant) in `CONVERTED`, all converted in one process."""
    try:
        vendored = vendored_llama_cpp()
    except RuntimeError as e:
        pytest.skip(f"llama.cpp's converter is not available: {e}")
    root = tmp_path_factory.mktemp("frontier-converter")
    results = convert(vendored, [(models[m], root / f"{m}-{q}.gguf", q) for m, q in CONVERTED], root / "results.json")

    def get(model: str, quant: str) -> Path:
        status = results[str(root / f"{model}-{quant}.gguf")]
        assert status == "ok", f"llama.cpp's converter failed on {model} ({quant}): {status}"
        return root / f"{model}-{quant}.gguf"

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("model", "quant"), CONVERTED)
def test_kiln_writes_what_llama_cpp_converter_writes(
    model: str,
    quant: str,
    exported: Callable[..., tuple[Path, ExportResult]],
    converted: Callable[[str, str], Path],
) -> None:
    """Tensor for tensor the converter's names, shapes, types and bytes (MLA's split latent, gpt-oss's split gate and
    up, the release's MXFP4 experts, FP8 dequantized as DeepSeek's kernel does, the prediction layer left out), and
    its metadata keys and values but `DIFFERENCES`."""
    path, res = exported(model, quant)
    peer = converted(model, quant)
    ours, theirs = gguf_tensors(path), gguf_tensors(peer)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        p = theirs[name]
        assert (t.tensor_type.name, list(t.shape)) == (p.tensor_type.name, list(p.shape)), name
        assert bytes(t.data) == bytes(p.data), f"{name}: {t.tensor_type.name} bytes differ"
    a, b = gguf_fields(path), gguf_fields(peer)
    differ = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert differ == set(DIFFERENCES), {k: (a.get(k), b.get(k)) for k in differ}
    assert a["general.architecture"][0] == ARCH[model] == res.details["architecture"]
    if ARCH[model] == "deepseek2":
        assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.exp_probs_b.bias"} <= set(ours)
        assert "blk.1.ffn_gate_shexp.weight" in ours and "blk.0.ffn_gate_inp.weight" not in ours  # dense layer 0
        assert not any(n.startswith("blk.2.") for n in ours)  # no prediction layer
    else:
        assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_exps.bias", "blk.0.ffn_gate_inp.bias"} <= set(ours)
    if model == "gpt_oss_mxfp4":
        assert ours["blk.0.ffn_gate_exps.weight"].tensor_type.name == "MXFP4"
        assert res.details["source_quantization"]["kept"]["tensors"] == 6
        assert (res.passed_through, res.dequantized) == ("mxfp4", None)  # the record's typed fields say the same
    if model == "deepseek_fp8":
        assert res.details["source_quantization"]["dequantized"]["tensors"] > 0
        assert (res.passed_through, res.dequantized) == (None, "fp8-block")
    if model in ("deepseek_v3", "gpt_oss"):
        assert (res.passed_through, res.dequantized) == (None, None)  # a plain source: nothing to say


def _decode_ocp(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The release's MXFP4 values, decoded here from the OCP layout: value 2k of a block in byte k's low nibble."""
    lut = np.array(FP4_VALUES, dtype=np.float32)
    values = np.stack((lut[blocks & 0x0F], lut[blocks >> 4]), axis=-1).reshape(*blocks.shape[:-1], 32)
    return (values * np.exp2(scales.astype(np.float32) - 127)[..., None]).reshape(*blocks.shape[:-2], -1)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["bf16", "mxfp4"])
def test_the_releases_mxfp4_experts_go_through_as_they_are(
    quant: str, models: dict[str, Path], exported: Callable[..., tuple[Path, ExportResult]]
) -> None:
    """Every MXFP4 expert tensor of the file is the release's: each block's exponent byte is the release's scale
    byte, and its 32 values, as gguf-py decodes ggml's block_mxfp4, are exactly the release's (the gate the even
    rows of gate_up, the up the odd ones, down as stored). Nothing is dequantized and quantized again."""
    from safetensors import safe_open

    path, res = exported("gpt_oss_mxfp4", quant)
    assert res.details["source_quantization"]["kept"]["tensors"] == 6
    tensors = gguf_tensors(path)
    with safe_open(str(models["gpt_oss_mxfp4"] / "model.safetensors"), "np") as f:
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts."
            gate_up = f.get_tensor(p + "gate_up_proj_blocks"), f.get_tensor(p + "gate_up_proj_scales")
            down = f.get_tensor(p + "down_proj_blocks"), f.get_tensor(p + "down_proj_scales")
            wanted = {
                "ffn_gate_exps": (gate_up[0][:, 0::2], gate_up[1][:, 0::2]),
                "ffn_up_exps": (gate_up[0][:, 1::2], gate_up[1][:, 1::2]),
                "ffn_down_exps": down,
            }
            for name, (blocks, scales) in wanted.items():
                t = tensors[f"blk.{layer}.{name}.weight"]
                assert t.tensor_type.name == "MXFP4"
                raw = np.asarray(t.data).reshape(*scales.shape, 17)
                assert np.array_equal(raw[..., 0], scales), name  # the exponents, byte for byte
                decoded = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(blocks.shape[:2] + (-1,))
                assert np.array_equal(decoded, _decode_ocp(blocks, scales)), name


def test_mxfp4_blocks_are_repacked_not_recomputed() -> None:
    """ggml's block_mxfp4 from OCP MX blocks (`mxfp4_from_ocp`): the same values as gguf-py decodes them, every
    exponent byte kept, and byte j holding values j and j + 16 (ggml-common.h), on every nibble and exponent."""
    from kiln.formats.gguf.quants import mxfp4_from_ocp

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(3, 5, 4), dtype=np.uint8)
    packed = mxfp4_from_ocp(blocks, scales)
    assert packed.shape == (3, 5, 4 * 17) and packed.dtype == np.uint8
    raw = packed.reshape(3, 5, 4, 17)
    assert np.array_equal(raw[..., 0], scales)
    nibbles = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(3, 5, 4, 32)
    assert np.array_equal(raw[..., 1:] & 0x0F, nibbles[..., :16])
    assert np.array_equal(raw[..., 1:] >> 4, nibbles[..., 16:])
    decoded = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4).reshape(3, 5, 128)
    assert np.array_equal(decoded, _decode_ocp(blocks, scales))


def _dequantized_copy(src: Path, out: Path) -> Path:
    """A plain float32 copy of a pre-quantized release, its weights dequantized (`SourceModel.iter_dequantized`):
    what the reference is computed from, loaded by transformers without its quantizers."""
    from safetensors.torch import save_file

    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    tensors = {n: t.to(torch.float32).contiguous() for n, t in open_source(src).iter_dequantized(dtype=torch.float32)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def reference(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[list[int], np.ndarray]]:
    """The token ids of TEXT and transformers' fp32 logits for them, per model (a release's from its dequantized
    weights); `yarn_truncate`: YaRN's correction range rounded out to whole dimensions, as llama.cpp computes it."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("frontier-reference")
    cache: dict[tuple[str, bool], tuple[list[int], np.ndarray]] = {}

    def get(model: str, yarn_truncate: bool = False) -> tuple[list[int], np.ndarray]:
        if (model, yarn_truncate) not in cache:
            src = models[model]
            ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
            if "quantization_config" in json.loads((src / "config.json").read_text()):
                src = root / model if (root / model).is_dir() else _dequantized_copy(src, root / model)
            config = AutoConfig.from_pretrained(src)
            if yarn_truncate:
                config.rope_parameters["truncate"] = True
            net = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32)
            with torch.no_grad():
                cache[model, yarn_truncate] = (ids, net(torch.tensor([ids])).logits[0].double().numpy())
        return cache[model, yarn_truncate]

    return get


def _kl(ref: np.ndarray, path: Path, ids: list[int]) -> tuple[np.ndarray, float]:
    """KL(transformers || llama.cpp) at each position, and top-1 agreement."""
    runtime = LlamaCppRuntime(path, n_ctx=512, vocab_size=ref.shape[1])
    try:
        got = runtime.logits(ids)[:, : ref.shape[1]].astype(np.float64)
    finally:
        runtime.close()
    return kl_divergence(log_softmax(ref), log_softmax(got)), float(np.mean(ref.argmax(-1) == got.argmax(-1)))


# llama.cpp against transformers (fp32 logits from the same weights; gpt-oss's with llama.cpp's YaRN rounding):
# mean KL per position and top-1. BF16 and F16 differ by llama.cpp's rounding of the activations it multiplies
# them with; the others by their quantization as well.
LIMITS = {
    "f16": (1e-6, 0.97),
    "bf16": (5e-5, 0.97),
    "q8_0": (2e-3, 0.8),
    "q6_k": (4e-3, 0.7),
    "q4_k_m": (2e-2, 0.4),
    "q4_0": (2e-2, 0.3),
    "nvfp4": (2e-2, 0.3),
    "mxfp4": (3e-2, 0.3),
}
# Measured on this file's models (AVX-512, 2026-11-29), mean KL over 240 positions, deepseek_v3 / gpt_oss:
# f16 1.2e-8 / 4.2e-8, bf16 9.0e-6 / 1.5e-5, q8_0 8.3e-5 / 3.4e-4, q6_k 1.1e-4 / 9.5e-4, q4_k_m 1.7e-3 / 5.9e-3,
# q4_0 4.2e-3 / 7.8e-3, nvfp4 3.1e-3 / 1.0e-2, mxfp4 5.6e-3 / 1.2e-2. The releases' files: deepseek_fp8 F16
# 2.9e-9, gpt_oss_mxfp4 BF16 (MXFP4 experts as released) 2.8e-7.


@pytest.mark.slow
@pytest.mark.parametrize("quant", list(LIMITS))
@pytest.mark.parametrize("model", ["deepseek_v3", "gpt_oss"])
def test_llama_cpp_logits_agree_with_transformers(
    model: str, quant: str, exported: Callable[..., tuple[Path, ExportResult]], reference: Callable[..., Any]
) -> None:
    """llama.cpp 0.3.36 loads kiln's file in every GGUF type and computes what transformers computes, to the type's
    precision: MLA absorbed, sigmoid group-limited routing with the correction bias, shared experts and the dense
    first layer (deepseek2); sinks, the sliding and full layers, biased experts' clamped SwiGLU (gpt-oss)."""
    ids, ref = reference(model, yarn_truncate=model == "gpt_oss")
    assert len(ids) > 64  # past gpt-oss's window of 16: its sliding layers attend within it
    path, _ = exported(model, quant)
    kl, top1 = _kl(ref, path, ids)
    limit, min_top1 = LIMITS[quant]
    assert kl.mean() <= limit and top1 >= min_top1, (kl.mean(), top1)


@pytest.mark.slow
def test_deepseek_yarn_is_llama_cpps(exported: Callable[..., tuple[Path, ExportResult]], reference: Any) -> None:
    """DeepSeek's YaRN, mscale = mscale_all_dim: transformers leaves the rope unscaled and multiplies the softmax's
    scale by mscale squared; kiln writes llama.cpp's yarn_log_multiplier (0.1 x mscale_all_dim), from which deepseek2
    computes the same scale. Without that key llama.cpp disagrees (KL 8e-4 here)."""
    ids, ref = reference("deepseek_yarn")
    path, _ = exported("deepseek_yarn", "f16")
    assert gguf.GGUFReader(path).fields["deepseek2.rope.scaling.yarn_log_multiplier"].contents() == pytest.approx(0.1)
    kl, top1 = _kl(ref, path, ids)
    assert kl.mean() <= 1e-6 and top1 >= 0.99, (kl.mean(), top1)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek_fp8", "gpt_oss_mxfp4"])
def test_a_release_scores_as_its_dequantized_weights(
    model: str, exported: Callable[..., tuple[Path, ExportResult]], reference: Callable[..., Any]
) -> None:
    """A release in its published format: its bf16 file (MXFP4 experts kept as released; FP8 dequantized into bf16,
    F16 here as F16 keeps more of it) computes what transformers computes from the release's dequantized weights:
    KL ~ 0, the rounding of llama.cpp's activations."""
    quant = "f16" if model == "deepseek_fp8" else "bf16"
    ids, ref = reference(model)
    kl, top1 = _kl(ref, exported(model, quant)[0], ids)
    assert kl.mean() <= 1e-6 and top1 >= 0.97, (kl.mean(), top1)


@pytest.mark.slow
def test_gpt_oss_yarn_is_llama_cpps(exported: Callable[..., tuple[Path, ExportResult]], reference: Any) -> None:
    """gpt-oss's config keeps YaRN's correction range unrounded (`truncate: false`); llama.cpp's rope rounds it out to
    whole dimensions (ggml_rope_yarn_corr_dims: floor and ceil), for every model. The file is right: it agrees with
    transformers computing that rounding to KL ~ 1e-8, and with transformers as configured only to its cost here
    (here, head_dim 16, the ramp over pairs 2.02-4.35 of 8 becomes 2-5: KL 4.2e-8 against 9.7e-5; DeepSeek's YaRN
    truncates, as llama.cpp does)."""
    ids, rounded = reference("gpt_oss", yarn_truncate=True)
    _, configured = reference("gpt_oss")
    path, res = exported("gpt_oss", "f16")
    assert "rounds it out to whole dimensions" in res.details["llama_cpp_computes"][0]
    assert _kl(rounded, path, ids)[0].mean() <= 1e-6
    assert 1e-5 < _kl(configured, path, ids)[0].mean() <= 1e-3


@pytest.mark.slow
def test_deepseek_routes_by_sigmoid_in_llama_cpp(
    models: dict[str, Path], reference: Any, tmp_path: Path, exported: Callable[..., tuple[Path, ExportResult]]
) -> None:
    """transformers' DeepseekV3Config keeps no `scoring_func`, so llama.cpp's converter writes no
    expert_gating_func for a model transformers saved, and llama.cpp then routes by softmax (DeepSeek-V2's).
    kiln writes sigmoid for every DeepSeek-V3: without the key its file disagrees with transformers (KL 8.8e-4
    against 1.2e-8)."""
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    plain = tmp_path / "without-scoring-func"
    shutil.copytree(models["deepseek_v3"], plain)
    config = json.loads((plain / "config.json").read_text())
    del config["scoring_func"]
    (plain / "config.json").write_text(json.dumps(config))
    res = export(open_source(plain), ExportRequest(quant="f16", out_dir=tmp_path / "out", params={"name": "tiny"}))
    path = tmp_path / "out" / res.files[0]
    key = "deepseek2.expert_gating_func"
    assert gguf.GGUFReader(path).fields[key].contents() == 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    without = tmp_path / "without-gating.gguf"
    copy_with_new_metadata(gguf.GGUFReader(path), gguf.GGUFWriter(without, arch="deepseek2"), {}, [key])
    ids, ref = reference("deepseek_v3")
    assert _kl(ref, path, ids)[0].mean() <= 1e-6
    assert _kl(ref, without, ids)[0].mean() > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_the_plan_from_headers_is_what_is_written(
    model: str, models: dict[str, Path], exported: Callable[..., tuple[Path, ExportResult]]
) -> None:
    """Names, shapes (experts stacked, kv_b and gate_up split) and types planned from the SafeTensors headers alone
    are the file's; the placement's byte count (`gguf_bytes`, from config.json alone) is its tensors'."""
    source = open_source(models[model])
    for quant in ("bf16", "q8_0", "q4_k_m"):
        if quant == "q4_k_m" and model == "gpt_oss_mxfp4":
            continue  # refused: test_llama_cpps_quantizer_is_refused_for_a_releases_mxfp4_experts
        path, _ = exported(model, quant)
        written = {
            t.name: (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name, t.n_bytes)
            for t in gguf.GGUFReader(path).tensors
        }
        if QUANTS[quant].llama_ftype is None:
            plans = plan_tensors(source.tensors, source.shape, QUANTS[quant])
            assert {p.name: (p.shape, p.ttype.name) for p in plans} == {n: w[:2] for n, w in written.items()}
        assert gguf_bytes(source.shape, quant) == sum(w[2] for w in written.values()), quant


@pytest.mark.parametrize("quant", ["bf16", "q8_0", "mxfp4"])
@pytest.mark.parametrize("model", MODELS)
def test_every_file_passes_the_lint(
    model: str, quant: str, exported: Callable[..., tuple[Path, ExportResult]], models: dict[str, Path]
) -> None:
    """What the writer writes, the lint (which the export stage runs) passes, against the source's config and
    against the file's own keys (MLA's sizes read back from them)."""
    from kiln.targets.lint import lint_artifact

    path, _ = exported(model, quant)
    for shape in (open_source(models[model]).shape, None):
        report = lint_artifact(path.parent, shape=shape, quant=quant, target="gguf")
        assert report.errors == [], [(f.code, f.subject, f.message) for f in report.errors]


def test_llama_cpps_quantizer_is_refused_for_a_releases_mxfp4_experts(models: dict[str, Path], tmp_path: Path) -> None:
    """Q4_K_M and Q6_K are made by llama.cpp's quantizer, which would decode the release's MXFP4 experts and quantize
    them again: refused at plan time (the target's model check) and at export, naming the kept types."""
    source = open_source(models["gpt_oss_mxfp4"])
    spec = get_target("gguf")
    for quant in ("q4_k_m", "q6_k"):
        with pytest.raises(InvalidInput, match="requantize the release's MXFP4 experts") as e:
            spec.check_model(source.shape, source.config, quant, {})
        assert e.value.code == "GGUF_UNSUPPORTED" and e.value.details["quant"] == quant
    with pytest.raises(InvalidInput, match="bf16 or f16 keep them"):
        export(source, ExportRequest(quant="q4_k_m", out_dir=tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before anything is written
    for quant in ("bf16", "q8_0", "mxfp4"):
        spec.check_model(source.shape, source.config, quant, {})


def _config(models: dict[str, Path], model: str, **changes: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((models[model] / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("deepseek_v3", {"q_lora_rank": None}, "q_lora_rank is null"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave is false"),
    ("deepseek_v3", {"attention_bias": True}, "reads no attention biases"),
    ("deepseek_v3", {"rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}}, "mscale=1.0 differs"),
    (
        "deepseek_v3",
        {"rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": False}},
        "truncate",
    ),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "scaling 'linear'"),
    ("gpt_oss", {"rope_parameters": {"attention_factor": 2.0}}, "sets attention_factor"),
]


@pytest.mark.parametrize(("model", "changes", "says"), REFUSED)
def test_what_llama_cpp_computes_differently_is_refused(
    model: str, changes: dict[str, Any], says: str, models: dict[str, Path]
) -> None:
    shape = ModelShape.from_config(_config(models, model, **changes))
    with pytest.raises(InvalidInput, match=f"as llama.cpp's {ARCH[model]}: .*{says}") as e:
        check_supported(shape)
    assert e.value.code == "GGUF_UNSUPPORTED"
    check_supported(ModelShape.from_config(_config(models, model)))  # the unchanged model is written


def test_the_released_configs_are_written() -> None:
    """DeepSeek-V3's, gpt-oss-120b's and gpt-oss-20b's released config.json (examples/: YaRN factor 40 with mscale =
    mscale_all_dim = 1; YaRN factor 32 unrounded, 128-token windows) pass llama.cpp's checks."""
    examples = Path(__file__).parents[2] / "examples"
    for name in ("deepseek-v3", "gpt-oss-120b", "gpt-oss-20b"):
        check_supported(ModelShape.from_config(json.loads((examples / name / "config.json").read_text())))


@pytest.mark.parametrize(("example", "layers", "experts"), [("gpt-oss-120b", 36, 128), ("gpt-oss-20b", 24, 32)])
def test_gpt_oss_as_released_is_its_release_in_gguf(example: str, layers: int, experts: int) -> None:
    """gpt-oss's bf16 GGUF is its release (examples/<example>/config.json, sized from the shape alone): the MXFP4
    experts' 17 bytes per 32 weights and every bf16 tensor as released, but for what llama.cpp keeps in F32 (norms,
    biases, sinks, the router), 2 bytes more per element. By hand: hidden 2880, 64 heads and 8 KV heads of 64,
    experts of 2880."""
    from kiln.placement.weights import source_bytes

    h, q, kv, ff = 2880, 64 * 64, 8 * 64, 2880
    per_layer = 2 * h + q + 2 * kv + h + 64 + experts * h + experts + experts * 2 * ff + experts * h
    f32_elements = layers * per_layer + h  # and the final norm
    config = json.loads((Path(__file__).parents[2] / "examples" / example / "config.json").read_text())
    shape = ModelShape.from_config(config)
    assert gguf_bytes(shape, "bf16") == source_bytes(shape, 2, extras=False) + 2 * f32_elements
