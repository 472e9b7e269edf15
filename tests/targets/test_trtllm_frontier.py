"""trtllm for DeepSeek-V3 and gpt-oss: checkpoints in the layout TensorRT-LLM's PyTorch backend reads for them.

On tiny random models made by transformers' own classes, plain (bf16) and in their released formats
(`tests/quantized_sources.py`: DeepSeek's FP8 with 128 x 128 block scales, gpt-oss's MXFP4 experts):
- DeepSeek-V3 bf16 (from a bf16 source, or dequantized from the FP8 release: its record says so) and fp8-block in
  DeepSeek's own spelling (`quant_method: fp8`, `weight_scale_inv`; the release's bytes where it kept them), with no
  prediction layer and `moe_layer_freq` written;
- gpt-oss bf16 (from its MXFP4 release: the experts dequantized, as hf-bundle's), and mxfp4-experts, the release's
  own layout, with the experts' `*_blocks` / `*_scales` kept byte for byte;
- every checkpoint checked by `schema.check_checkpoint` against the record's tensors as released (MLA's, every
  expert's, the shared expert's, the router's correction bias, sinks, biases): one missing is refused by name;
- what TensorRT-LLM cannot load is refused at plan time with the reason; GPU evals are planned per SKU, MXFP4's on
  the GPUs its fused MoE runs it on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import InvalidInput, KilnError
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.hf_model import SourceModel, open_source
from kiln.quant.catalog import get_scheme
from kiln.quant.store import QuantizedWeights, open_quantized, write_quantized
from kiln.targets.base import ExportRequest, ExportResult, get_target
from kiln.targets.trtllm.export import FP8_RELEASE_CONFIG, QUANTIZED, export
from kiln.targets.trtllm.formats import MOE_REFUSED
from kiln.targets.trtllm.schema import check_checkpoint
from tests.model_factory import make_model
from tests.quantized_sources import FP8_CONFIG, MXFP4_CONFIG, make_fp8_block_source, make_mxfp4_source

# Whole 128-wide blocks where TensorRT-LLM's FP8 DeepSeek-V3 cuts by them (intermediate 256, experts 128, the shared
# expert 128, the query latent 128); kv_a_proj_with_mqa's 136 rows and kv_b_proj's 192 end in a padded block.
DEEPSEEK: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "v_head_dim": 32,
    "moe_intermediate_size": 128,
}
GPUS = {"skus": ["h100", "h200", "b200"]}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("frontier")
    return {
        "deepseek_v3": make_model(root / "deepseek", "deepseek_v3", **DEEPSEEK),
        "deepseek_fp8": make_fp8_block_source(root / "deepseek_fp8", "deepseek_v3", **DEEPSEEK),
        "gpt_oss": make_model(root / "gpt_oss", "gpt_oss", hidden_size=64, intermediate_size=64),
        "gpt_oss_mxfp4": make_mxfp4_source(root / "gpt_oss_mxfp4"),
    }


def _quantized(source: SourceModel, quant: str, root: Path) -> QuantizedWeights:
    """The shared quantize stage's output (fp8-block: the release's bytes kept where it is an FP8 release)."""
    root.mkdir(parents=True)
    write_quantized(source, get_scheme(quant), root)
    return open_quantized(root, quant)


def _export(source: SourceModel, quant: str, out: Path, **params: object) -> ExportResult:
    q = _quantized(source, quant, out.parent / f"q-{quant}") if quant in QUANTIZED else None
    out.mkdir(parents=True)
    return export(source, ExportRequest(quant=quant, out_dir=out, params=dict(params), quantized=q))


def _tensors(ckpt: Path) -> dict[str, Any]:
    from safetensors import safe_open

    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def _raw(t: Any) -> bytes:
    import torch

    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


# -- what is written -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["deepseek_v3", "deepseek_fp8"])
def test_deepseek_bf16_holds_the_records_tensors_and_no_prediction_layer(
    model: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    import torch

    source = open_source(sources[model])
    result = _export(source, "bf16", tmp_path / "ckpt", max_shard_bytes=400_000)
    checked = check_checkpoint(tmp_path / "ckpt")
    assert checked.quant_algo is None and checked.source == "none"
    # Exactly the record's tensors: MLA's latents and norms, the dense layer, every expert, the shared expert, the
    # router and its correction bias; bf16, the source's values (the release's dequantized).
    expected = source.shape.expected_tensors()
    assert set(checked.tensors) == set(expected)
    assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in expected)
    assert any(n.endswith("self_attn.kv_b_proj.weight") for n in expected)
    stored = _tensors(tmp_path / "ckpt")
    for name in expected:
        want = source.dequantized(name).to(torch.bfloat16)
        assert stored[name].dtype == torch.bfloat16 and torch.equal(stored[name], want), name
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["moe_layer_freq"] == 1 and not any(".layers.2." in n for n in stored)  # no prediction layer
    assert "quantization_config" not in config
    if model == "deepseek_fp8":
        assert result.dequantized == "fp8-block" and result.passed_through is None
    else:
        assert result.dequantized is None and result.passed_through is None
    assert result.runtime["architecture"] == "DeepseekV3ForCausalLM"
    assert set(result.served() or {}) >= {"a100", "h100", "b200"}


@pytest.mark.parametrize("model", ["deepseek_v3", "deepseek_fp8"])
def test_deepseek_fp8_block_is_deepseeks_own_spelling_with_the_releases_bytes(
    model: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    source = open_source(sources[model])
    result = _export(source, "fp8-block", tmp_path / "ckpt", max_shard_bytes=400_000)
    ckpt = tmp_path / "ckpt"
    checked = check_checkpoint(ckpt)
    assert checked.quant_algo == "FP8_BLOCK_SCALES" and checked.source == "config.json" and checked.group_size == 128
    config = json.loads((ckpt / "config.json").read_text())
    # The release's own quantization_config (TensorRT-LLM's load_hf_quant_config: quant_method fp8 with
    # weight_block_size is FP8_BLOCK_SCALES); from a bf16 source, DeepSeek's.
    assert config["quantization_config"] == (FP8_CONFIG if model == "deepseek_fp8" else FP8_RELEASE_CONFIG)
    stored = _tensors(ckpt)
    scales = sorted(n for n in stored if n.endswith(".weight_scale_inv"))
    assert not any(n.endswith(".weight_scale") for n in stored)
    # Every decoder Linear: MLA's five, the dense MLP, 8 experts and the shared one in the sparse layer.
    assert len(scales) == 2 * 5 + 3 + 3 * (8 + 1)
    assert any(".mlp.experts.7.down_proj." in n for n in scales) and any(".shared_experts." in n for n in scales)
    assert result.runtime["quantization"]["release_layout"] == "fp8-block"
    assert {"h100", "h200", "b200"} <= set(result.served() or {}) and not {"a100", "l40s"} & set(result.served() or {})
    if model == "deepseek_v3":
        assert result.passed_through is None and result.dequantized is None
        return
    # The release's FP8 values and float32 scales, byte for byte, under the release's names.
    released = _tensors(sources[model])
    assert sorted(n for n in released if n.endswith(".weight_scale_inv")) == scales
    for scale in scales:
        weight = scale.removesuffix("_scale_inv")
        assert _raw(stored[weight]) == _raw(released[weight]), weight
        assert stored[scale].dtype == released[scale].dtype and _raw(stored[scale]) == _raw(released[scale]), scale
    assert result.passed_through == "fp8-block" and result.dequantized is None


@pytest.mark.parametrize(
    ("model", "quant"), [("gpt_oss", "bf16"), ("gpt_oss_mxfp4", "bf16"), ("gpt_oss_mxfp4", "mxfp4-experts")]
)
def test_gpt_oss_mxfp4_experts_keeps_a_releases_experts_as_released(
    model: str, quant: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    import torch

    source = open_source(sources[model])
    result = _export(source, quant, tmp_path / "ckpt", max_shard_bytes=100_000)
    ckpt = tmp_path / "ckpt"
    checked = check_checkpoint(ckpt)
    stored = _tensors(ckpt)
    names = set(stored)
    # Sinks, attention and router biases, the stacked experts' biases: the record's, in bf16.
    for part in ("self_attn.sinks", "self_attn.o_proj.bias", "mlp.router.bias", "mlp.experts.down_proj_bias"):
        assert f"model.layers.1.{part}" in names, part
    if quant == "bf16":  # bf16 is bf16: a release's experts dequantized (exact), as hf-bundle's bf16 holds them
        assert checked.quant_algo is None and set(checked.tensors) == set(source.shape.expected_tensors())
        assert result.passed_through is None
        assert result.dequantized == ("mxfp4" if model == "gpt_oss_mxfp4" else None)
        assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
        assert set(result.served() or {}) >= {"a100", "h100", "b200"}
        return
    assert checked.quant_algo == "MXFP4" and checked.source == "config.json" and checked.group_size == 32
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"] == MXFP4_CONFIG
    released = _tensors(sources[model])
    kept = sorted(n for n in released if n.endswith(("_blocks", "_scales")))
    assert kept and kept == sorted(n for n in stored if n.endswith(("_blocks", "_scales")))
    for name in kept:  # TensorRT-LLM's load_hf_weights reads these names and de-interleaves them itself
        assert stored[name].dtype == torch.uint8 and _raw(stored[name]) == _raw(released[name]), name
    for name in names - set(kept):
        assert torch.equal(stored[name], released[name].to(torch.bfloat16)), name
    assert result.passed_through == "mxfp4" and result.dequantized is None
    assert result.runtime["quantization"]["quant_algo"] == "MXFP4"
    # TensorRT-LLM's MXFP4 experts: W4A16_MXFP4 on Hopper (Triton), W4A8 on Blackwell; not on Ampere or Ada.
    assert {"h100", "h200", "b200"} <= set(result.served() or {}) and not {"a100", "l40s"} & set(result.served() or {})


@pytest.mark.parametrize("model", ["gpt_oss", "gpt_oss_mxfp4"])
def test_gpt_oss_config_has_the_rope_keys_tensorrt_llm_reads(
    model: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """TensorRT-LLM's gpt-oss AttentionBlock reads `rope_theta` and `rope_scaling[...]` by key; transformers 5 writes
    `rope_parameters` only, so the checkpoint carries both, with the source's values."""
    source = json.loads((sources[model] / "config.json").read_text())
    assert "rope_scaling" not in source and "rope_theta" not in source  # as transformers 5 writes it
    _export(open_source(sources[model]), "bf16", tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    rope = source["rope_parameters"]
    assert config["rope_theta"] == rope["rope_theta"] == 150_000.0
    assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        assert isinstance(config["rope_scaling"][key], int | float), key


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("rope_scaling", "rope_scaling.factor"),
        ("rope_scaling.beta_fast", "rope_scaling.beta_fast"),
        ("rope_scaling.original_max_position_embeddings", "rope_scaling.original_max_position_embeddings"),
        ("rope_theta", "rope_theta"),
    ],
)
def test_a_gpt_oss_config_without_a_rope_key_is_refused_naming_it(
    drop: str, named: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    _export(open_source(sources["gpt_oss"]), "bf16", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    if "." in drop:
        key, sub = drop.split(".")
        del config[key][sub]
    else:
        del config[drop]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidInput) as e:
        check_checkpoint(ckpt)
    assert e.value.code == "TRTLLM_CHECKPOINT" and named in e.value.details["missing"], e.value.message
    assert named in e.value.message and "rope_scaling" in e.value.message


# -- a checkpoint missing one tensor is refused by name -------------------------------------------------------


def _without(ckpt: Path, drop: str) -> None:
    """Rewrite the shard holding `drop` without it, as a checkpoint that lost that tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(drop)
    with safe_open(str(ckpt / shard), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != drop}  # noqa: SIM118
    save_file(kept, str(ckpt / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("model", "quant", "drop"),
    [
        ("deepseek_fp8", "fp8-block", "model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"),
        ("deepseek_fp8", "fp8-block", "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"),
        ("deepseek_v3", "bf16", "model.layers.1.mlp.gate.e_score_correction_bias"),
        ("deepseek_v3", "bf16", "model.layers.1.mlp.shared_experts.down_proj.weight"),
        ("gpt_oss", "bf16", "model.layers.0.self_attn.sinks"),
        ("gpt_oss_mxfp4", "mxfp4-experts", "model.layers.1.self_attn.sinks"),
        ("gpt_oss_mxfp4", "mxfp4-experts", "model.layers.0.mlp.experts.down_proj_scales"),
        ("gpt_oss_mxfp4", "mxfp4-experts", "model.layers.1.mlp.experts.gate_up_proj_bias"),
    ],
)
def test_a_checkpoint_missing_one_tensor_is_refused_naming_it(
    model: str, quant: str, drop: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    _export(open_source(sources[model]), quant, tmp_path / "ckpt", max_shard_bytes=100_000)
    _without(tmp_path / "ckpt", drop)
    with pytest.raises(InvalidInput) as e:
        check_checkpoint(tmp_path / "ckpt")
    assert e.value.code == "TRTLLM_CHECKPOINT" and e.value.details["tensor"] == drop
    assert f"{drop}:" in e.value.message and "missing" in e.value.message


def test_an_extra_tensor_such_as_a_prediction_layers_is_refused(sources: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    _export(open_source(sources["deepseek_v3"]), "bf16", ckpt)
    save_file({"model.layers.2.enorm.weight": torch.ones(128, dtype=torch.bfloat16)}, str(ckpt / "extra.safetensors"))
    with pytest.raises(InvalidInput, match=r"would not load: \['model.layers.2.enorm.weight'\]"):
        check_checkpoint(ckpt)


# -- refused at plan time, with the reason --------------------------------------------------------------------


def _shape(model_dir: Path, **change: object) -> ModelShape:
    config = json.loads((model_dir / "config.json").read_text())
    return ModelShape.from_config({**config, **change})


@pytest.mark.parametrize(
    ("model", "quant", "why"),
    [
        ("deepseek_v3", "fp8", MOE_REFUSED["FP8_PER_CHANNEL_PER_TOKEN"]),
        ("deepseek_v3", "int4-rtn", MOE_REFUSED["W4A16_AWQ"]),
        ("deepseek_v3", "nvfp4-w4a4", "NVFP4's weight_scale, weight_scale_2 and input_scale for them are never"),
        ("gpt_oss", "fp8-block", "would read FP8 block-scaled experts; kiln's schemes leave the stacked experts"),
        ("gpt_oss", "fp8", "no FP8 rowwise method; kiln's schemes leave the stacked experts in bf16"),
        ("gpt_oss", "w4a16-awq", "no per-group int4 weight-only method"),
        ("gpt_oss", "nvfp4-w4a4", "cannot load gpt-oss's 1-D expert biases"),
    ],
)
def test_schemes_tensorrt_llm_cannot_load_are_refused_with_the_reason(
    model: str, quant: str, why: str, sources: dict[str, Path]
) -> None:
    spec = get_target("trtllm")
    with pytest.raises(InvalidInput) as e:
        spec.check_model(_shape(sources[model]), {}, quant, {})
    assert e.value.code == "QUANT_UNSUPPORTED" and why in e.value.details["reason"], e.value.message
    assert f"trtllm-{quant} cannot serve" in e.value.message


@pytest.mark.parametrize(
    ("model", "quant", "change", "code", "words"),
    [
        # The tiny model's own widths: 32-wide experts are no whole 128-wide block.
        ("deepseek_v3", "fp8-block", {"moe_intermediate_size": 32}, "QUANT_UNSUPPORTED", "moe_intermediate_size=32"),
        ("deepseek_v3", "fp8-block", {"q_lora_rank": 96}, "QUANT_UNSUPPORTED", "q_lora_rank=96"),
        ("deepseek_v3", "bf16", {"norm_topk_prob": False}, "TARGET_ARCHITECTURE_UNSUPPORTED", "renormalises"),
        (
            "gpt_oss",
            "bf16",
            {"layer_types": ["full_attention", "sliding_attention"]},
            "TARGET_ARCHITECTURE_UNSUPPORTED",
            "layer_idx % 2 == 0",
        ),
        (
            "gpt_oss",
            "bf16",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}},
            "TARGET_ARCHITECTURE_UNSUPPORTED",
            "rope is 'default', not 'yarn'",
        ),
        (
            "gpt_oss",
            "bf16",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10_000.0}},
            "TARGET_ARCHITECTURE_UNSUPPORTED",
            "gives no original_max_position_embeddings, beta_fast, beta_slow",
        ),
    ],
)
def test_configs_tensorrt_llm_would_compute_or_load_differently_are_refused(
    model: str, quant: str, change: dict[str, object], code: str, words: str, sources: dict[str, Path]
) -> None:
    spec = get_target("trtllm")
    spec.check_model(_shape(sources[model]), {}, quant, {})  # the tiny model as made is served
    with pytest.raises(InvalidInput) as e:
        spec.check_model(_shape(sources[model], **change), {}, quant, {})
    assert e.value.code == code and words in e.value.message, e.value.message


def test_legacy_engines_are_refused_for_both_families(sources: dict[str, Path]) -> None:
    spec = get_target("trtllm")
    engines = {"skus": ["h100"], "max_batch_size": 1, "max_input_len": 64, "max_seq_len": 128}
    for model in ("deepseek_v3", "gpt_oss"):
        with pytest.raises(InvalidInput) as e:
            spec.check_model(_shape(sources[model]), {}, "bf16", {"legacy_engines": engines})
        assert e.value.code == "ENGINE_UNSUPPORTED" and "serves the PyTorch backend" in e.value.message


# -- planned: the GPU evals per SKU ---------------------------------------------------------------------------


def _plan(tmp_path: Path, model_dir: Path, entry: dict[str, Any]) -> list[Any]:
    from kiln.pipeline.build import plan
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "heldout.txt").write_text("hello world " * 200)
    recipe = tmp_path / "kiln.yaml"
    doc = {"model": "m", "version": "1", "source": str(model_dir), "eval": {"text": "heldout.txt"}, "targets": [entry]}
    recipe.write_text(json.dumps(doc))
    return plan(load_recipe(recipe, allowed_roots=[model_dir.parent]), open_store(None, tmp_path / "work"))


@pytest.mark.parametrize(
    ("model", "quants", "skus"),
    [
        ("deepseek_v3", ["bf16"], ["a100", "h100", "b200"]),
        ("deepseek_fp8", ["bf16", "fp8-block"], ["h100", "h200", "b200"]),
        ("gpt_oss", ["bf16"], ["a100", "h200"]),
        ("gpt_oss_mxfp4", ["bf16"], ["a100", "h200"]),
        ("gpt_oss_mxfp4", ["mxfp4-experts"], ["h100", "b200"]),
    ],
)
def test_gpu_evals_are_planned_per_sku_and_deferred(
    model: str, quants: list[str], skus: list[str], sources: dict[str, Path], tmp_path: Path
) -> None:
    entry = {"target": "trtllm", "quants": quants, "params": {"gpus": {"skus": skus}}}
    nodes = _plan(tmp_path, sources[model], entry)
    evals = [n for n in nodes if n.id.startswith("gpu-eval/")]
    assert [n.id for n in evals] == [f"gpu-eval/trtllm-{q}@{sku}" for q in quants for sku in skus]
    assert all(n.params["tensorrt_llm"] == "1.3.0rc20" and n.params["runtime"] == "tensorrt_llm" for n in evals)


@pytest.mark.parametrize("sku", ["a100", "l40s"])
def test_a_sku_that_cannot_run_mxfp4_experts_is_refused_at_plan(
    sku: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """mxfp4-experts keeps the release's experts: TensorRT-LLM reads them as W4A16_MXFP4 below sm100, which its
    fused MoE runs on Hopper alone (CutlassFusedMoE._QUANT_SUPPORT_TABLE), so Ampere and Ada are refused by name."""
    entry = {"target": "trtllm", "quants": ["mxfp4-experts"], "params": {"gpus": {"skus": ["h100", sku]}}}
    with pytest.raises(KilnError) as e:
        _plan(tmp_path, sources["gpt_oss_mxfp4"], entry)
    # Refused when the recipe is read (the scheme's own SKUs: `engines.check_skus`).
    assert e.value.code == "RECIPE_INVALID" and f"trtllm-mxfp4-experts on {sku}" in e.value.message
    assert "MXFP4 experts need sm90+" in e.value.message, e.value.message
