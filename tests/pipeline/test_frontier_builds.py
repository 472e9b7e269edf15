"""DeepSeek-V3 and gpt-oss built end to end: tiny random models made by transformers' own classes, plain (bf16) and
in their released formats (DeepSeek's FP8 128 x 128 blocks, gpt-oss's MXFP4 experts, written by
tests/quantized_sources.py), planned, ingested, their reference computed, and hf-bundle / rocm-bundle artifacts
built and evaluated in transformers (vLLM is left out: its environment points at an empty directory).

A target that keeps the release's format writes the release's bytes (fp8-block: its FP8 values and scales, byte
for byte; rocm-bundle's e4m3fnuz: the same values re-encoded, the scales doubled) and scores KL ~ 0 against the
reference (the release dequantized); one that changes the format dequantizes first and its records say so. The
catalog's refusals (`quant.catalog.source_route`) are given at plan time, one test per class of reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors import safe_open

from kiln.core.errors import KilnError
from kiln.core.hardware import PROFILES
from kiln.pipeline import build
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.store import WorkDir
from kiln.quant.footprint import checkpoint_bytes
from tests.model_factory import make_model
from tests.quantized_sources import make_fp8_block_source, make_mxfp4_source
from tests.test_end_to_end import ROOT, kiln

# Every Linear's input a whole number of 128-wide blocks (vLLM's block-FP8 and int4 groups), its rows not always:
# q_b_proj 96 rows, kv_a_proj_with_mqa 136 (DeepSeek-V3's is 576), kv_b_proj 192 end in a zero-padded block.
DEEPSEEK_BLOCKS: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "v_head_dim": 32,
    "moe_intermediate_size": 128,
}
# A random model predicts almost uniformly, so its top two tokens are close and any rounding swaps them (as
# tests/test_families.py): the gates of what rounds keep their KL and need a third of the positions' top token;
# what keeps the release's bytes keeps its default gate.
LOOSE = {"min_top1": 0.3, "max_kl": 0.05, "max_ppl_increase": 0.1}
GATES = {"bf16": {"min_top1": 0.9}, "fp8": LOOSE, "int4-rtn": LOOSE, "w4a16-gptq": LOOSE, "nvfp4-w4a16": LOOSE}
GFX942 = {"gfx_arch": "gfx942", "fp8_dtype": "e4m3fnuz", "vllm": "0.11.2", "rocm": "7.0.2"}
KL_ZERO = 1e-6


def _recipe(root: Path, targets: list[dict[str, Any]], *, calibration: bool = False) -> Path:
    held_out = (ROOT / "examples" / "tiny-llama" / "heldout.txt").read_text()
    (root / "heldout.txt").write_text(held_out[:12000])
    recipe: dict[str, Any] = {
        "model": "frontier",
        "version": "1.0.0",
        "source": "model",
        "eval": {
            "text": "heldout.txt",
            "max_tokens": 256,
            "window": 64,
            "greedy_prompts": 1,
            "greedy_tokens": 4,
            "gates": {q: gate for q, gate in GATES.items() if any(q in t["quants"] for t in targets)},
        },
        "targets": targets,
    }
    if calibration:
        (root / "calibration.txt").write_text((ROOT / "examples" / "tiny-llama" / "train.py").read_text())
        recipe["calibration"] = {"text": "calibration.txt", "samples": 4, "seq_len": 64}
    (root / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    return root / "kiln.yaml"


def _build(recipe: Path, work: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "KILN_WORK_DIR": str(work),
        "KILN_RUNTIMES": str(work.parent / "no-runtimes"),
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    }
    built: dict[str, Any] = json.loads(kiln("build", str(recipe), "--json", env=env).stdout)
    assert built["failed_gates"] == [] and built["deferred"] == []
    return built


def _artifacts(built: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each artifact's build entry, with its export record (`record`) and its transformers eval (`first`)."""
    out = {}
    for a in built["artifacts"]:
        assert a["eval"] == "passed", (a["artifact"], a["failures"])
        first = a["evals"][0]
        assert first["runtime"] in ("transformers", "jax") and first["status"] == "passed"
        record = json.loads((Path(a["path"]).parent / "stage.json").read_text())["result"]
        out[a["artifact"]] = {**a, "record": record, "first": first}
    return out


def _stage_records(work: Path, stage: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text())["result"] for p in sorted((work / stage).glob("*/stage.json"))]


def _tensors(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def _raw(t: Any) -> bytes:
    import torch

    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_a_plain_model_of_each_family_builds_its_bundles(family: str, tmp_path: Path) -> None:
    """bf16 sources: the reference and hf-bundle bf16 and FP8 bundles, held whole (neither family streams)."""
    sizes = DEEPSEEK_BLOCKS if family == "deepseek_v3" else {}
    make_model(tmp_path / "model", family, **sizes)
    recipe = _recipe(tmp_path, [{"target": "hf-bundle", "quants": ["bf16", "fp8"]}])
    work = tmp_path / "work"
    nodes = build.plan(load_recipe(recipe), WorkDir(work))
    reference = next(n for n in nodes if n.id == "reference/source")
    assert reference.requires.weights is not None and reference.requires.weights.whole
    artifacts = _artifacts(_build(recipe, work))
    assert sorted(artifacts) == ["hf-bundle-bf16", "hf-bundle-fp8"]
    assert artifacts["hf-bundle-bf16"]["metrics"]["kl"] <= KL_ZERO  # the source's bf16 weights, float32 both ways
    for a in artifacts.values():
        assert "passed_through" not in a["record"] and "dequantized" not in a["record"]
    (reference_record,) = _stage_records(work, "reference")
    assert "dequantized" not in reference_record


def test_an_fp8_block_release_keeps_its_bytes_where_the_format_is_kept(tmp_path: Path) -> None:
    source = make_fp8_block_source(tmp_path / "model", "deepseek_v3", **DEEPSEEK_BLOCKS)
    recipe = _recipe(
        tmp_path,
        [
            {"target": "hf-bundle", "quants": ["bf16", "fp8-block", "int4-rtn"]},
            {"target": "rocm-bundle", "quants": ["fp8-block"], "params": GFX942},
        ],
    )
    work = tmp_path / "work"
    artifacts = _artifacts(_build(recipe, work))
    (reference,) = _stage_records(work, "reference")
    assert reference["dequantized"] == "fp8-block"

    released = _tensors(source / "model.safetensors")
    scales = {n.removesuffix("_scale_inv"): n for n in released if n.endswith(".weight_scale_inv")}
    assert len(scales) == 2 * 5 + 3 + 3 * (8 + 1)  # MLA's five Linears a layer, the dense MLP, 8 experts and the shared

    # fp8-block: the release's FP8 values and float32 scales, byte for byte, under compressed-tensors' names.
    bundle = artifacts["hf-bundle-fp8-block"]
    stored = _tensors(Path(bundle["path"]) / "model.safetensors")
    for weight, scale in scales.items():
        assert _raw(stored[weight]) == _raw(released[weight]), weight
        assert stored[weight + "_scale"].dtype == released[scale].dtype
        assert _raw(stored[weight + "_scale"]) == _raw(released[scale]), scale
    config = json.loads((Path(bundle["path"]) / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    assert config["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    assert bundle["record"]["passed_through"] == "fp8-block" and "dequantized" not in bundle["record"]
    assert bundle["metrics"]["kl"] <= KL_ZERO and bundle["metrics"]["top1"] == 1.0
    assert "activations unquantized as in the reference" in bundle["first"]["runtime_version"]

    # rocm-bundle for gfx942: the same values in e4m3fnuz (each halved exactly), every scale doubled.
    from kiln.targets.rocm_bundle.fnuz import fnuz_scale, fnuz_weight

    rocm = artifacts["rocm-bundle-fp8-block"]
    fnuz = _tensors(Path(rocm["path"]) / "model.safetensors")
    for weight, scale in scales.items():
        assert _raw(fnuz[weight]) == _raw(fnuz_weight(released[weight])), weight
        assert _raw(fnuz[weight + "_scale"]) == _raw(fnuz_scale(released[scale])), scale
    assert rocm["record"]["passed_through"] == "fp8-block" and rocm["metrics"]["kl"] <= KL_ZERO

    # What changes the format dequantizes first, and says so: bf16, and int4 from the dequantized weights.
    for name in ("hf-bundle-bf16", "hf-bundle-int4-rtn"):
        record = artifacts[name]["record"]
        assert record["dequantized"] == "fp8-block" and "passed_through" not in record, name
        assert "activations unquantized" not in artifacts[name]["first"]["runtime_version"]
    assert artifacts["hf-bundle-bf16"]["metrics"]["kl"] <= 1e-5  # the dequantized weights rounded to bf16
    quantized = {r["scheme"]["name"]: r for r in _stage_records(work, "quantize")}
    assert quantized["fp8-block"]["passed_through"] == "fp8-block" and "dequantized" not in quantized["fp8-block"]
    assert quantized["int4-rtn"]["dequantized"] == "fp8-block" and "passed_through" not in quantized["int4-rtn"]


def test_an_mxfp4_release_builds_bf16_with_its_experts_dequantized(tmp_path: Path) -> None:
    make_mxfp4_source(tmp_path / "model", hidden_size=64, intermediate_size=64)
    recipe = _recipe(tmp_path, [{"target": "hf-bundle", "quants": ["bf16"]}])
    work = tmp_path / "work"
    artifacts = _artifacts(_build(recipe, work))
    (reference,) = _stage_records(work, "reference")
    assert reference["dequantized"] == "mxfp4"
    bundle = artifacts["hf-bundle-bf16"]
    assert bundle["record"]["dequantized"] == "mxfp4" and "passed_through" not in bundle["record"]
    # Every E2M1 value times a power of two is a bf16: the experts as the reference computes them, exactly.
    assert bundle["metrics"]["kl"] <= KL_ZERO
    stored = _tensors(Path(bundle["path"]) / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 128)
    assert not any(n.endswith(("_blocks", "_scales")) for n in stored)


@pytest.mark.slow
def test_calibrated_schemes_from_an_fp8_release_calibrate_its_dequantized_weights(tmp_path: Path) -> None:
    """FP8 -> NVFP4 for Blackwell and FP8 -> W4A16 (GPTQ) for Ampere: llm-compressor calibrates a dequantized copy."""
    make_fp8_block_source(tmp_path / "model", "deepseek_v3", **DEEPSEEK_BLOCKS)
    recipe = _recipe(tmp_path, [{"target": "hf-bundle", "quants": ["nvfp4-w4a16", "w4a16-gptq"]}], calibration=True)
    work = tmp_path / "work"
    artifacts = _artifacts(_build(recipe, work))
    for name in ("hf-bundle-nvfp4-w4a16", "hf-bundle-w4a16-gptq"):
        assert artifacts[name]["record"]["dequantized"] == "fp8-block"
    for record in _stage_records(work, "quantize"):
        assert record["dequantized"] == "fp8-block" and record["calibration"] is not None


# -- what the catalog refuses from a pre-quantized source, one class of reason each --------------------------


def _refusal(tmp_path: Path, targets: list[dict[str, Any]]) -> KilnError:
    recipe = load_recipe(_recipe(tmp_path, targets, calibration=True))
    with pytest.raises(KilnError) as e:
        build.plan(recipe, WorkDir(tmp_path / "work"), hash_source=False)
    return e.value


def test_another_8bit_format_from_an_fp8_release_is_refused(tmp_path: Path) -> None:
    make_fp8_block_source(tmp_path / "model", "deepseek_v3", **DEEPSEEK_BLOCKS)
    for quant in ("fp8", "int8-w8a8", "fp8-kv8"):
        e = _refusal(tmp_path, [{"target": "hf-bundle", "quants": [quant]}])
        assert e.code == "QUANT_SOURCE_REFUSED" and e.details["quant"] == quant
        assert "a second rounding for the same bytes" in e.message and "fp8-block" in e.message


def test_a_scheme_that_leaves_mxfp4_experts_in_bf16_is_refused(tmp_path: Path) -> None:
    make_mxfp4_source(tmp_path / "model")
    for quant in ("fp8-block", "int4-rtn", "mxfp4-w4a4"):
        e = _refusal(tmp_path, [{"target": "hf-bundle", "quants": [quant]}])
        assert e.code == "QUANT_SOURCE_REFUSED" and e.details["layout"] == "mxfp4"
        assert "four times their released bytes" in e.message


def test_fp8_blocks_that_are_not_the_schemes_are_refused(tmp_path: Path) -> None:
    make_fp8_block_source(tmp_path / "model", block=(64, 64))
    e = _refusal(tmp_path, [{"target": "hf-bundle", "quants": ["fp8-block"]}])
    assert e.code == "QUANT_SOURCE_REFUSED"
    assert "the release's blocks are 64x64 and fp8-block's 128x128" in e.message


def test_fp8_blocks_whose_columns_overhang_are_refused(tmp_path: Path) -> None:
    """The release's own format, but inputs that are no whole number of blocks: vLLM does not read them."""
    make_fp8_block_source(tmp_path / "model", "deepseek_v3")  # q_b_proj reads a 32-wide query latent
    e = _refusal(tmp_path, [{"target": "rocm-bundle", "quants": ["fp8-block"], "params": GFX942}])
    assert e.code == "QUANT_SHAPE" and e.details["layer"] == "model.layers.0.self_attn.q_b_proj.weight"
    assert "vLLM quantizes its activations in groups of 128 input columns" in e.message


def test_an_fp8_release_of_a_streamed_family_builds_orbax_and_trtllm(tmp_path: Path) -> None:
    """A Qwen3-"FP8"-style release of a family the layer stream covers: orbax bf16 and TensorRT-LLM bf16
    dequantize it, TensorRT-LLM's fp8-block keeps its bytes and scores KL ~ 0 streamed or whole."""
    make_fp8_block_source(tmp_path / "model", hidden_size=128, intermediate_size=256, num_kv_heads=4)
    recipe = _recipe(
        tmp_path, [{"target": "orbax", "quants": ["bf16"]}, {"target": "trtllm", "quants": ["bf16", "fp8-block"]}]
    )
    artifacts = _artifacts(_build(recipe, tmp_path / "work"))
    for name in ("orbax-bf16", "trtllm-bf16"):
        assert artifacts[name]["record"]["dequantized"] == "fp8-block", name
    kept = artifacts["trtllm-fp8-block"]
    assert kept["record"]["passed_through"] == "fp8-block" and kept["metrics"]["kl"] <= KL_ZERO


def test_an_fp8_release_of_deepseek_builds_trtllm_in_its_own_spelling(tmp_path: Path) -> None:
    """TensorRT-LLM reads DeepSeek-V3's FP8 as released: fp8-block keeps the release's values and scales under their
    names (`weight_scale_inv`, `quant_method: fp8`) and scores KL ~ 0; bf16 dequantizes it and says so."""
    source = make_fp8_block_source(tmp_path / "model", "deepseek_v3", **DEEPSEEK_BLOCKS)
    recipe = _recipe(tmp_path, [{"target": "trtllm", "quants": ["bf16", "fp8-block"]}])
    artifacts = _artifacts(_build(recipe, tmp_path / "work"))
    assert artifacts["trtllm-bf16"]["record"]["dequantized"] == "fp8-block"
    kept = artifacts["trtllm-fp8-block"]
    assert kept["record"]["passed_through"] == "fp8-block" and "dequantized" not in kept["record"]
    assert kept["metrics"]["kl"] <= KL_ZERO and kept["metrics"]["top1"] == 1.0
    released = _tensors(source / "model.safetensors")
    stored = _tensors(Path(kept["path"]) / "model.safetensors")
    scales = [n for n in released if n.endswith(".weight_scale_inv")]
    assert scales and sorted(scales) == sorted(n for n in stored if n.endswith("_scale_inv"))
    for scale in scales:
        weight = scale.removesuffix("_scale_inv")
        assert _raw(stored[weight]) == _raw(released[weight]) and _raw(stored[scale]) == _raw(released[scale]), scale
    config = json.loads((Path(kept["path"]) / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["moe_layer_freq"] == 1


def test_an_mxfp4_release_keeps_its_bytes_as_mxfp4_experts(tmp_path: Path) -> None:
    """gpt-oss as released, built in its own layout (mxfp4-experts) by hf-bundle, rocm-bundle (gfx950) and
    TensorRT-LLM: the experts' blocks and scales byte for byte, config.json's quantization_config as released, the rest
    bf16, KL ~ 0 against the reference (the release dequantized). trtllm-bf16 dequantizes the experts, as hf-bundle's
    bf16 does, and says so."""
    source = make_mxfp4_source(tmp_path / "model", hidden_size=64, intermediate_size=64)
    gfx950 = {"gfx_arch": "gfx950", "vllm": "0.11.2", "rocm": "7.0.2"}
    recipe = _recipe(
        tmp_path,
        [
            {"target": "hf-bundle", "quants": ["mxfp4-experts"]},
            {"target": "rocm-bundle", "quants": ["mxfp4-experts"], "params": gfx950},
            {"target": "trtllm", "quants": ["bf16", "mxfp4-experts"]},
        ],
    )
    work = tmp_path / "work"
    artifacts = _artifacts(_build(recipe, work))
    assert _stage_records(work, "quantize") == []  # the release's bytes: nothing quantized
    released = _tensors(source / "model.safetensors")
    released_config = json.loads((source / "config.json").read_text())["quantization_config"]
    blocks = [n for n in released if n.endswith(("_blocks", "_scales"))]
    assert len(blocks) == 2 * 2 * 2  # two layers, gate_up and down, blocks and scales
    for name in ("hf-bundle-mxfp4-experts", "rocm-bundle-mxfp4-experts", "trtllm-mxfp4-experts"):
        kept = artifacts[name]
        assert kept["record"]["passed_through"] == "mxfp4" and "dequantized" not in kept["record"], name
        print(f"\n{name} of the MXFP4 gpt-oss release: {json.dumps(kept['metrics'])}")
        assert kept["metrics"]["kl"] <= KL_ZERO and kept["metrics"]["top1"] == 1.0, (name, kept["metrics"])
        stored = _tensors(Path(kept["path"]) / "model.safetensors")
        for tensor in blocks:
            assert stored[tensor].dtype == released[tensor].dtype, (name, tensor)
            assert _raw(stored[tensor]) == _raw(released[tensor]), (name, tensor)
        assert {n for n, t in stored.items() if n not in blocks} == {n for n in released if n not in blocks}
        assert all(str(t.dtype) == "torch.bfloat16" for n, t in stored.items() if n not in blocks), name
        config = json.loads((Path(kept["path"]) / "config.json").read_text())
        assert config["quantization_config"] == released_config, name
        # Sized from config.json alone (`quant.footprint`): the release's layout, to the byte.
        written = sum(t.numel() * t.element_size() for t in stored.values())
        assert checkpoint_bytes(json.loads((source / "config.json").read_text()), "mxfp4-experts") == written
    bundle = artifacts["hf-bundle-mxfp4-experts"]["record"]
    assert bundle["runtime"]["quantization"] == {"method": "mxfp4", "scheme": "mxfp4-experts"}
    assert {"a100", "h100", "b200", "mi300x", "mi355x", "cpu"} <= set(bundle["hardware"])
    assert "AITER" in artifacts["rocm-bundle-mxfp4-experts"]["record"]["runtime"]["fp4"]["kernels"]

    # TensorRT-LLM: the release's MXFP4 experts on Hopper and Blackwell, not on Ampere and Ada (the decision that
    # chose the hardware: the MXFP4 experts, not a bf16 scheme's).
    trt = artifacts["trtllm-mxfp4-experts"]["record"]
    assert not {"a100", "l40s"} & set(trt["hardware"]) and {"h100", "b200"} <= set(trt["hardware"])
    for sku in ("a100", "l40s"):
        assert "MXFP4 experts need sm90+" in trt["unsupported"][sku], trt["unsupported"][sku]
    assert set(trt["unsupported"]) == set(PROFILES) - set(trt["hardware"])
    # trtllm-bf16 is bf16: the experts dequantized, on every NVIDIA GPU from Ampere.
    bf16 = artifacts["trtllm-bf16"]
    assert bf16["record"]["dequantized"] == "mxfp4" and "passed_through" not in bf16["record"]
    assert bf16["metrics"]["kl"] <= KL_ZERO and "a100" in bf16["record"]["hardware"]
    stored = _tensors(Path(bf16["path"]) / "model.safetensors")
    assert not any(n.endswith(("_blocks", "_scales")) for n in stored)
    assert "quantization_config" not in json.loads((Path(bf16["path"]) / "config.json").read_text())


def test_mxfp4_experts_is_refused_where_there_is_no_mxfp4_release(tmp_path: Path) -> None:
    """A release's own layout is only kept, never made: refused at plan for a plain gpt-oss (kiln quantizes no stacked
    experts) and for DeepSeek-V3's FP8 release (no MXFP4 experts to keep), each with its code and reason."""
    make_model(tmp_path / "model", "gpt_oss")
    for target in ("hf-bundle", "trtllm"):
        e = _refusal(tmp_path, [{"target": target, "quants": ["mxfp4-experts"]}])
        assert e.code == "QUANT_RELEASE_ONLY" and e.details["quant"] == "mxfp4-experts", target
        assert "this source is plain (unquantized), and kiln quantizes no stacked experts" in e.message, target
    fp8 = tmp_path / "fp8"
    make_fp8_block_source(fp8 / "model", "deepseek_v3", **DEEPSEEK_BLOCKS)
    e = _refusal(fp8, [{"target": "hf-bundle", "quants": ["mxfp4-experts"]}])
    assert e.code == "QUANT_SOURCE_REFUSED" and e.details["layout"] == "fp8-block"
    assert "an FP8 release has no MXFP4 experts to keep" in e.message
    # orbax writes no MXFP4: refused when the recipe is read, with the reason.
    with pytest.raises(KilnError, match="refuses quant 'mxfp4-experts'.*XLA on the TPUs it targets has no MXFP4"):
        load_recipe(_recipe(tmp_path, [{"target": "orbax", "quants": ["mxfp4-experts"]}]))


def test_fp8_and_mxfp4_releases_build_orbax_from_their_dequantized_weights(tmp_path: Path) -> None:
    """DeepSeek-V3 as released (FP8 128 x 128 blocks) and gpt-oss as released (MXFP4 experts): orbax bf16 is built
    from the release dequantized, says so, and its JAX eval (MLA, sinks, both routers) passes against the reference
    (the same dequantized weights, rounded to bf16 for the checkpoint)."""
    for family in ("deepseek_v3", "gpt_oss"):
        root = tmp_path / family
        if family == "deepseek_v3":
            make_fp8_block_source(root / "model", "deepseek_v3", **DEEPSEEK_BLOCKS)
        else:
            make_mxfp4_source(root / "model", hidden_size=64, intermediate_size=64)
        recipe = _recipe(root, [{"target": "orbax", "quants": ["bf16"]}])
        artifacts = _artifacts(_build(recipe, root / "work"))
        orbax = artifacts["orbax-bf16"]
        layout = "fp8-block" if family == "deepseek_v3" else "mxfp4"
        assert orbax["record"]["dequantized"] == layout and "passed_through" not in orbax["record"], family
        assert orbax["first"]["runtime"] == "jax", family
        print(f"\norbax-bf16 of the {layout} {family} release: {json.dumps(orbax['metrics'])}")
        assert orbax["metrics"]["kl"] <= 1e-4, (family, orbax["metrics"])
        weights = json.loads((Path(orbax["path"]) / "weights.json").read_text())["tensors"]
        assert all(w["dtype"] == "bfloat16" for w in weights.values()), family
        assert not any(n.endswith(("_scale_inv", "_blocks", "_scales")) for n in weights), family
