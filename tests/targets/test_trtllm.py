"""trtllm: checkpoints that validate against what TensorRT-LLM's PyTorch backend reads, with the tensors
each QuantAlgo loads; FP8 evaluated by transformers, int4 deferred to a GPU runner; refusals with reasons."""

from __future__ import annotations

import json
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInput, RecipeInvalid, StageFailed
from kiln.core.hardware import PROFILES
from kiln.formats.architectures import ARCHITECTURES, LINEAR_WEIGHT
from kiln.formats.architectures.record import TensorKind
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.hf_model import SourceModel, open_source
from kiln.pipeline.recipe import Recipe, parse_recipe
from kiln.quant.catalog import get_method, get_scheme
from kiln.quant.rtn import dequantize
from kiln.quant.store import QuantizedWeights, open_quantized, write_quantized
from kiln.targets.base import ExportRequest, ExportResult, get_target
from kiln.targets.trtllm.export import export, pack_int4_rows, unpack_int4_rows
from kiln.targets.trtllm.formats import FORMATS as ALL_FORMATS
from kiln.targets.trtllm.formats import MOE_REFUSED, algo_verdict
from kiln.targets.trtllm.schema import (
    HF_QUANT_CONFIG,
    LINEAR_TENSORS,
    check_checkpoint,
    compressed_tensors_algo,
    compressed_tensors_kv_algo,
    fused_groups,
    parse_hf_quant_config,
)
from tests.model_factory import FAMILIES as FACTORY_FAMILIES
from tests.model_factory import NEW_FAMILIES, make_model

GOOD_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.33.0"},
    "quantization": {"quant_algo": "W4A16_AWQ", "group_size": 128, "pre_quant_scale": True, "exclude_modules": []},
}


# The schemes this module's plain models quantize: a release-only method (mxfp4-experts, a release's own layout) is
# refused by the catalog at plan for any other source and built in tests/targets/test_trtllm_frontier.py.
FORMATS = {quant: fmt for quant, fmt in ALL_FORMATS.items() if not get_method(quant).release_only}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 128 input columns everywhere: whole 128-column groups and 128x128 FP8 blocks.
    return make_model(tmp_path_factory.mktemp("llama128"), hidden_size=128, intermediate_size=256, num_kv_heads=4)


@pytest.fixture(scope="module")
def quantized(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, QuantizedWeights]:
    """The shared quantize stage's output for every trtllm scheme (calibrated ones on a little stdlib text)."""
    from kiln.quant.calibrated import calibrate, calibration_samples

    source = open_source(model_dir)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    out = {}
    for quant, fmt in FORMATS.items():
        if fmt.quant_algo is None:
            continue
        scheme = get_scheme(quant)
        cal = None
        if scheme.calibrated:
            cal = calibrate(source, scheme, calibration_samples(model_dir, text, samples=4, seq_len=64))
        root = tmp_path_factory.mktemp(quant)
        write_quantized(source, scheme, root, calibrated=cal)
        out[quant] = open_quantized(root, quant)
    return out


def _export(source: SourceModel, quant: str, out: Path, q: QuantizedWeights | None, **params: object) -> ExportResult:
    out.mkdir(parents=True)
    return export(source, ExportRequest(quant=quant, out_dir=out, params=dict(params), quantized=q))


def test_hf_quant_config_schema_takes_tensorrt_llm_names_and_refuses_the_rest() -> None:
    parsed = parse_hf_quant_config(GOOD_CONFIG)
    assert parsed.quantization.quant_algo == "W4A16_AWQ" and parsed.quantization.kv_cache_quant_algo is None
    bad = [
        ({"quant_algo": "INT8"}, "quant_algo"),  # a KV-cache algo only
        ({"quant_algo": "W4A16_AWQ", "group_size": None}, "needs group_size"),
        ({"quant_algo": "NVFP4", "group_size": 32}, "group_size 16 only"),
        ({"quant_algo": "FP8", "kv_cache_quant_algo": "FP4"}, "kv_cache_quant_algo"),
        ({"quant_algo": "MIXED_PRECISION"}, "quantized_layers"),
        ({"quant_algo": "FP8", "quant_method": "fp8"}, "quant_method"),
    ]
    for override, words in bad:
        doc = {**GOOD_CONFIG, "quantization": {**GOOD_CONFIG["quantization"], **override}}
        with pytest.raises(InvalidInput) as e:
            parse_hf_quant_config(doc)
        assert e.value.code == "TRTLLM_QUANT_CONFIG" and words in e.value.message, e.value.message
    with pytest.raises(InvalidInput, match="producer"):
        parse_hf_quant_config({"quantization": GOOD_CONFIG["quantization"]})


@pytest.mark.parametrize("quant", list(FORMATS))
def test_every_checkpoint_validates_and_carries_the_tensors_its_algo_loads(
    quant: str, model_dir: Path, quantized: dict[str, QuantizedWeights], tmp_path: Path
) -> None:
    import torch
    from safetensors import safe_open

    fmt, source = FORMATS[quant], open_source(model_dir)
    q = quantized.get(quant)
    result = _export(source, quant, tmp_path / "ckpt", q, max_shard_bytes=200_000)
    ckpt = tmp_path / "ckpt"
    checked = check_checkpoint(ckpt)
    assert checked.quant_algo == fmt.quant_algo and result.eval_runtimes == fmt.eval_runtimes
    config = json.loads((ckpt / "config.json").read_text())
    if fmt.layout == "modelopt":
        assert checked.source == HF_QUANT_CONFIG and "quantization_config" not in config
        assert parse_hf_quant_config(json.loads((ckpt / HF_QUANT_CONFIG).read_text())).producer.name == "kiln"
        assert checked.group_size == (16 if fmt.quant_algo == "NVFP4" else 128)
        assert checked.exclude_modules == ("lm_head",)
    elif fmt.layout == "compressed-tensors":
        assert checked.source == "config.json" and not (ckpt / HF_QUANT_CONFIG).exists()
        assert compressed_tensors_algo(config["quantization_config"]) == fmt.quant_algo
    else:
        assert checked.source == "none" and "quantization_config" not in config
    assert result.runtime.get("quantization", {}).get("quant_algo") == fmt.quant_algo
    kv_algo = "FP8" if q is not None and q.scheme.kv_cache is not None else None
    assert checked.kv_cache_quant_algo == kv_algo
    assert result.runtime.get("quantization", {}).get("kv_cache_quant_algo") == kv_algo
    if kv_algo is not None:  # the calibrated scales travel (vLLM reads them); TensorRT-LLM's unit scale is recorded
        assert compressed_tensors_kv_algo(config["quantization_config"]) == "FP8"
        scales = {}
        for name in q.kv_scales():
            with safe_open(str(ckpt / checked.tensors[name].file), "pt") as f:
                scales[name] = f.get_tensor(name)
            assert torch.equal(scales[name], q.tensor(name)), name
        assert len(scales) == 2 * 2
        kv = result.details["kv_cache"]
        worst = max(scales, key=lambda n: float(scales[n].max()))
        assert kv["calibrated_max_scale"] == {"tensor": worst, "value": float(scales[worst].max())}
        assert kv["clips_at_unit_scale"] == sorted(n for n, t in scales.items() if float(t.max()) > 1.0)
    assert len(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]) == len(checked.tensors)

    # The values: what TensorRT-LLM's Linear computes with is exactly what the quantize stage chose.
    compared = 0
    for name in checked.tensors:
        if not (name.endswith(".weight") and LINEAR_WEIGHT.match(name)):
            continue
        module = name.removesuffix(".weight")
        stored = {}
        for k, info in checked.tensors.items():  # a module's tensors may lie in different shards
            if k.startswith(module + "."):
                with safe_open(str(ckpt / info.file), "pt") as f:
                    stored[k] = f.get_tensor(k)
        specs = {s.suffix for s in LINEAR_TENSORS[fmt.quant_algo]}
        assert {k.removeprefix(module + ".") for k in stored} == specs
        if q is None:
            assert torch.equal(stored[name], source.tensor(name).to(torch.bfloat16))
        elif fmt.quant_algo == "NVFP4":  # compressed-tensors' bytes; the tensor scales inverted, as scalars
            assert torch.equal(stored[name], q.tensor(f"{module}.weight_packed"))
            assert torch.equal(
                stored[f"{module}.weight_scale"].view(torch.uint8), q.tensor(f"{module}.weight_scale").view(torch.uint8)
            )
            for theirs, ours in (("weight_scale_2", "weight_global_scale"), ("input_scale", "input_global_scale")):
                assert stored[f"{module}.{theirs}"].shape == ()
                assert torch.equal(stored[f"{module}.{theirs}"], (1.0 / q.tensor(f"{module}.{ours}")).reshape(()))
        elif fmt.layout == "modelopt":
            want = dequantize(q.scheme, module, {k: q.tensor(k) for k in q.module_tensors(name)})
            values = unpack_int4_rows(stored[name])
            assert int(values.min()) >= -8 and int(values.max()) <= 7
            got = values.float() * stored[f"{module}.weight_scale"].float().repeat_interleave(128, dim=1)
            assert torch.equal(got, want)
            assert torch.equal(stored[f"{module}.pre_quant_scale"], torch.ones(got.shape[1], dtype=torch.bfloat16))
        else:
            for k in q.module_tensors(name):
                assert torch.equal(stored[k], q.tensor(k)), k
        compared += 1
    assert compared == 2 * 7


def test_int4_rows_pack_as_tensorrt_llm_unpacks_them() -> None:
    import torch

    values = torch.tensor([[1, -8, 7], [-1, 0, -3]], dtype=torch.int8)
    packed = pack_int4_rows(values)
    # Row 0 in the low nibble, row 1 in the high one: 1 | (-1 & 15) << 4 = 0xF1.
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xF1, 0x08, 0xD7]]
    every = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 1).T.contiguous()  # (16, 2): all values, both nibbles
    assert torch.equal(unpack_int4_rows(pack_int4_rows(every)), every)
    with pytest.raises(InvalidInput, match="pairs of output rows"):
        pack_int4_rows(torch.zeros(3, 4, dtype=torch.int8))


def test_checker_names_the_tensor_tensorrt_llm_would_not_load(
    model_dir: Path, quantized: dict[str, QuantizedWeights], tmp_path: Path
) -> None:
    _export(open_source(model_dir), "int4-rtn", tmp_path / "ckpt", quantized["int4-rtn"])
    doc = json.loads((tmp_path / "ckpt" / HF_QUANT_CONFIG).read_text())
    doc["quantization"]["group_size"] = 64
    (tmp_path / "ckpt" / HF_QUANT_CONFIG).write_text(json.dumps(doc))
    with pytest.raises(InvalidInput) as e:
        check_checkpoint(tmp_path / "ckpt")
    assert e.value.code == "TRTLLM_CHECKPOINT"
    assert "model.layers.0.self_attn.q_proj.weight_scale: W4A16_AWQ needs BF16/F16 [128, 2]" in e.value.message


def test_compressed_tensors_reader_mirror_explains_the_refused_int8_schemes() -> None:
    from kiln.quant.compressed import quantization_config

    # TensorRT-LLM reads bit width and strategy only: int8 W8A8 would load as FP8 rowwise.
    assert compressed_tensors_algo(quantization_config(get_scheme("int8-w8a8"))) == "FP8_PER_CHANNEL_PER_TOKEN"
    with pytest.raises(InvalidInput, match="weight-only"):
        compressed_tensors_algo(quantization_config(get_scheme("int8-w8a16")))
    # An 8-bit float KV cache is kv_cache_quant_algo FP8; TensorRT-LLM refuses any other kv_cache_scheme.
    assert compressed_tensors_kv_algo(quantization_config(get_scheme("fp8-kv8"))) == "FP8"
    assert compressed_tensors_kv_algo(quantization_config(get_scheme("fp8"))) is None
    with pytest.raises(InvalidInput, match="kv_cache_scheme"):
        compressed_tensors_kv_algo({"kv_cache_scheme": {"num_bits": 8, "type": "int"}})
    spec = get_target("trtllm")
    assert set(spec.unsupported_quants) == {"int8-w8a8", "int8-w8a16", "nvfp4-w4a16", "mxfp4-w4a4"}
    assert not set(spec.quants) & set(spec.unsupported_quants)


@pytest.mark.parametrize("quant", ["nvfp4-w4a4", "nvfp4-w4a4-gptq"])
def test_nvfp4_checkpoint_is_what_compressed_tensors_modelopt_converter_reads_back(
    model_dir: Path, quantized: dict[str, QuantizedWeights], tmp_path: Path, quant: str
) -> None:
    """Cross-check with compressed-tensors' own ModelOpt NVFP4 converter: converting kiln's TensorRT-LLM
    checkpoint gives back the hf-bundle's compressed-tensors tensors (the tensor scales to within the one
    rounding 1 / (1 / x) can add), for min-max and GPTQ-chosen weights alike (GPTQ keeps the fused
    projections' shared tensor scales, or the export would refuse it)."""
    import torch
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from safetensors import safe_open

    q = quantized[quant]
    _export(open_source(model_dir), quant, tmp_path / "ckpt", q)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    converted = ModelOptNvfp4Converter(ignore=["lm_head"], targets=["Linear"]).validate(tensors)
    ours = {k: q.tensor(k) for k in q.tensors}
    assert set(ours) <= set(converted)
    for k, t in ours.items():
        back = converted[k]
        if k.endswith("_global_scale"):
            assert back.numel() == 1 and torch.allclose(back.reshape(1), t.reshape(1), rtol=2**-23, atol=0), k
        else:
            assert torch.equal(back.view(torch.uint8), t.view(torch.uint8)), k


def test_fused_linears_with_different_tensor_scales_are_refused(
    model_dir: Path, quantized: dict[str, QuantizedWeights], tmp_path: Path
) -> None:
    """TensorRT-LLM asserts q/k/v (and gate/up) share weight_scale_2 and input_scale: such a checkpoint is refused."""
    import torch

    from kiln.targets.hf_bundle.export import plan_tensors
    from kiln.targets.trtllm.export import to_modelopt_nvfp4

    source = open_source(model_dir)
    planned = plan_tensors(source, quantized["nvfp4-w4a4"], lambda n: None)
    assert len(to_modelopt_nvfp4(planned, fused_groups(source.shape))) == len(planned)
    k = next(i for i, p in enumerate(planned) if p.name == "model.layers.0.self_attn.k_proj.input_global_scale")
    planned[k] = replace(planned[k], read=lambda: torch.tensor([1234.5]))
    with pytest.raises(StageFailed) as e:
        to_modelopt_nvfp4(planned, fused_groups(source.shape))
    assert e.value.code == "TRTLLM_FUSED_SCALES" and "q_proj/k_proj/v_proj" in e.value.message


def test_fp8_checkpoint_evaluates_on_cpu_and_int4_is_deferred_to_a_gpu_runner(
    model_dir: Path, quantized: dict[str, QuantizedWeights], tmp_path: Path
) -> None:
    import numpy as np

    from kiln.eval.gates import gate_for
    from kiln.eval.run import evaluate_artifact
    from kiln.eval.runtimes import TransformersRuntime
    from kiln.eval.text import load_text

    source = open_source(model_dir)
    fp8 = _export(source, "fp8", tmp_path / "fp8", quantized["fp8"])
    hf = get_target("hf-bundle")
    (tmp_path / "hf").mkdir()
    hf.export(source, ExportRequest(quant="fp8", out_dir=tmp_path / "hf", quantized=quantized["fp8"]))
    ids = list(range(0, 400, 7))
    # The same compressed-tensors tensors as the hf-bundle: transformers computes the same logits.
    assert np.array_equal(
        TransformersRuntime(tmp_path / "fp8").logits(ids), TransformersRuntime(tmp_path / "hf").logits(ids)
    )
    assert fp8.eval_runtimes == ("transformers", "vllm")

    int4 = _export(source, "w4a16-awq", tmp_path / "awq", quantized["w4a16-awq"])
    assert int4.eval_runtimes == ("tensorrt_llm",)
    (tmp_path / "heldout.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    text = load_text(model_dir, tmp_path / "heldout.txt", window=64, max_tokens=128, prompts=1, greedy_tokens=4)
    report = evaluate_artifact(
        TransformersRuntime(model_dir), int4.eval_runtimes[0], tmp_path / "awq", text, gate_for("w4a16-awq")
    )
    assert report.status == "not_evaluated" and not report.passed and report.metrics is None
    assert report.runtime_needed == "tensorrt_llm" and "GPU runner" in (report.reason or "")


def test_checkpoints_are_offered_only_where_tensorrt_llm_documents_their_algo(
    model_dir: Path, quantized: dict[str, QuantizedWeights], tmp_path: Path
) -> None:
    source = open_source(model_dir)
    expect = {
        "bf16": {"a100", "l40s", "h100", "h200", "b200", "gb200"},
        "fp8": {"h100", "h200"},
        "fp8-block": {"h100", "h200", "b200", "gb200"},
        "w4a16-awq": {"a100", "l40s", "h100", "h200"},
    }
    spec = get_target("trtllm")
    for quant, hardware in expect.items():
        result = _export(source, quant, tmp_path / quant, quantized.get(quant))
        assert set(result.served() or {}) == hardware, quant
        verdicts = spec.compatibility(quant, {})
        assert {hw for hw, v in verdicts.items() if v.compatible} == hardware
    verdicts = spec.compatibility("fp8", {})
    assert "FP8 needs sm89+" in verdicts["a100"].reason and "sm90 only" in verdicts["l40s"].reason
    assert "NVIDIA GPUs" in verdicts["cpu"].reason and "NVIDIA GPUs" in verdicts["mi300x"].reason
    assert "sm80, sm89, sm90 only; b200 is sm100" in spec.compatibility("w4a16-awq", {})["b200"].reason
    # The rules are data for every algo, kiln schemes or not: NVFP4 needs Blackwell.
    assert algo_verdict("NVFP4", PROFILES["h100"]).reason == "NVFP4 needs sm100 (Blackwell); h100 is sm90"
    assert algo_verdict("NVFP4", PROFILES["b200"]).compatible


def _recipe(tmp_path: Path, model_dir: Path, entry: dict) -> Recipe:
    (tmp_path / "heldout.txt").write_text("text " * 100)
    return parse_recipe(
        {"model": "m", "version": "1", "source": str(model_dir), "eval": {"text": "heldout.txt"}, "targets": [entry]},
        base_dir=tmp_path,
        allowed_roots=[model_dir],
    )


ENGINES = {"skus": ["h100", "h200"], "max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512}
GPUS = {"skus": ["h100", "h200"]}


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"target": "trtllm", "quants": ["int8-w8a16"]}, ["refuses quant 'int8-w8a16'", "no INT8 weight-only"]),
        ({"target": "trtllm", "quants": ["int8-w8a8"]}, ["refuses quant 'int8-w8a8'", "FP8_PER_CHANNEL_PER_TOKEN"]),
        (
            {"target": "trtllm", "quants": ["bf16"], "params": {"gpus": {"skus": ["h100", "h800"]}}},
            ["unknown engine SKU 'h800'", "known: a100, l40s, h100, h200, b200, b300, gb200, rtx-pro-6000"],
        ),
        (
            {"target": "trtllm", "quants": ["bf16", "fp8"], "params": {"gpus": {"skus": ["a100"]}}},
            ["trtllm-fp8 on a100", "FP8 needs sm89+ (Ada/Hopper); a100 is sm80"],
        ),
        (
            {"target": "trtllm", "quants": ["fp8"], "params": {"legacy_engines": {**ENGINES, "skus": ["l40s"]}}},
            ["trtllm-fp8 on l40s", "FP8 rowwise", "sm90 only; l40s is sm89"],
        ),
        (
            {"target": "trtllm", "quants": ["w4a16-awq"], "params": {"gpus": {"skus": ["b200"]}}},
            ["trtllm-w4a16-awq on b200", "W4A16 AWQ on sm80, sm89, sm90 only"],
        ),
        # A pinned release too old to load the checkpoint, with the reason and the change that fixed it.
        (
            {"target": "trtllm", "quants": ["fp8"], "params": {"gpus": {**GPUS, "tensorrt_llm": "1.2.0"}}},
            ["trtllm-fp8: tensorrt_llm 1.2.0 cannot load it; it needs >= 1.3.0rc20", "#15415"],
        ),
        (
            {"target": "trtllm", "quants": ["fp8-block"], "params": {"gpus": {**GPUS, "tensorrt_llm": "1.2.1"}}},
            ["needs >= 1.3.0rc1", "#10796"],
        ),
        ({"target": "trtllm", "quants": ["bf16"], "params": {"gpus": {**GPUS, "tensorrt_llm": "latest"}}}, ["pattern"]),
        # Legacy engines: a release with trtllm-build, schemes its own quantization makes.
        (
            {
                "target": "trtllm",
                "quants": ["bf16"],
                "params": {"legacy_engines": {**ENGINES, "tensorrt_llm": "1.3.0"}},
            },
            ["tensorrt_llm 1.3.0 has no trtllm-build", "last release is 1.3.0rc20"],
        ),
        ({"target": "trtllm", "quants": ["fp8-block"], "params": {"legacy_engines": ENGINES}}, ["no legacy engine"]),
        ({"target": "trtllm", "quants": ["w4a16-gptq"], "params": {"legacy_engines": ENGINES}}, ["no GPTQ format"]),
        ({"target": "trtllm", "quants": ["int4-rtn"], "params": {"legacy_engines": ENGINES}}, ["not round-to-nearest"]),
        (
            {"target": "trtllm", "quants": ["bf16"], "params": {"legacy_engines": {**ENGINES, "max_seq_len": 256}}},
            ["max_seq_len (256) must exceed max_input_len (256)"],
        ),
        (
            {"target": "trtllm", "quants": ["bf16"], "params": {"legacy_engines": {"skus": ["h100"]}}},
            ["max_batch_size"],
        ),
        # The old key names the two that replace it, rather than being read as either.
        ({"target": "trtllm", "quants": ["bf16"], "params": {"engines": ENGINES}}, ["gpus:", "legacy_engines:"]),
        ({"target": "trtllm", "quants": ["fp8"], "hardware": ["l40s"]}, ["trtllm-fp8 cannot serve l40s"]),
    ],
)
def test_recipe_refuses_what_tensorrt_llm_cannot_serve(
    entry: dict, words: list[str], model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(RecipeInvalid) as e:
        _recipe(tmp_path, model_dir, entry)
    assert e.value.message.startswith("recipe: targets[0]")
    for w in words:
        assert w in e.value.message, e.value.message


def test_recipe_plans_a_gpu_eval_per_sku_and_opt_in_legacy_engines(model_dir: Path, tmp_path: Path) -> None:
    spec = get_target("trtllm")
    assert spec.derived is not None
    recipe = _recipe(
        tmp_path, model_dir, {"target": "trtllm", "quants": ["bf16", "fp8", "w4a16-awq"], "params": {"gpus": GPUS}}
    )
    shape = open_source(model_dir).shape
    derived = [d for name, entry, quant in recipe.artifacts() for d in spec.derived(name, quant, entry.params, shape)]
    assert [d.name for d in derived] == [
        f"trtllm-{q}@{sku}" for q in ("bf16", "fp8", "w4a16-awq") for sku in GPUS["skus"]
    ]
    assert all(d.kind == "gpu-eval" and d.inputs == ("reference", "export") for d in derived)
    assert {d.params["tensorrt_llm"] for d in derived} == {"1.3.0rc20"}  # loads every scheme kiln writes
    assert [d.evaluates for d in derived[:2]] == ["trtllm-bf16", "trtllm-bf16"]

    older = {**ENGINES, "skus": ["a100", "l40s"]}
    recipe = _recipe(tmp_path, model_dir, {"target": "trtllm", "quants": ["bf16"], "params": {"legacy_engines": older}})
    (name, entry, quant), *_ = recipe.artifacts()
    engines = spec.derived(name, quant, entry.params, shape)
    assert [(d.kind, d.name, d.inputs, d.evaluates) for d in engines] == [
        ("engine", f"trtllm-bf16-{sku}", ("ingest",), None) for sku in ("a100", "l40s")
    ]
    assert engines[0].params["commands"][0][:2] == ["python3", "{examples}/models/core/llama/convert_checkpoint.py"]
    assert engines[0].params["commands"][1][0] == "trtllm-build"


# -- the families beyond Llama: Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3 ---------------------------------------

# What TensorRT-LLM's PyTorch backend loads per family, as kiln writes it (`schema.model_refusal`).
FAMILY_QUANTS = {
    "qwen3": {"bf16", "fp8", "int4-rtn", "nvfp4-w4a4"},
    "gemma3": {"bf16", "fp8", "int4-rtn", "nvfp4-w4a4"},
    "qwen3_moe": {"bf16", "nvfp4-w4a4"},
    "mixtral": {"bf16", "nvfp4-w4a4"},
    "phi3": {"bf16"},
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # 128 input columns everywhere (whole int4 groups and NVFP4 groups of 16), Qwen3-MoE's experts included.
    root = tmp_path_factory.mktemp("families")
    extra: dict[str, dict[str, object]] = {"qwen3_moe": {"moe_intermediate_size": 128}}
    return {
        f: make_model(root / f, f, hidden_size=128, intermediate_size=256, num_kv_heads=2, seed=i, **extra.get(f, {}))
        for i, f in enumerate(NEW_FAMILIES)
    }


def _rtn(source: SourceModel, quant: str, root: Path) -> QuantizedWeights:
    """The quantize stage's round-to-nearest output for `quant` (fp8, int4-rtn: no calibration)."""
    root.mkdir(parents=True)
    write_quantized(source, get_scheme(quant), root)
    return open_quantized(root, quant)


def _tensors(ckpt: Path, checked_tensors: dict) -> dict:
    from safetensors import safe_open

    out = {}
    for name, info in checked_tensors.items():
        with safe_open(str(ckpt / info.file), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_bf16_checkpoint_of_every_family_holds_its_record_tensors(
    family: str, family_models: dict[str, Path], tmp_path: Path
) -> None:
    import torch

    source = open_source(family_models[family])
    result = _export(source, "bf16", tmp_path / "ckpt", None, max_shard_bytes=300_000)
    checked = check_checkpoint(tmp_path / "ckpt")
    assert checked.quant_algo is None and result.details["architecture"] == FACTORY_FAMILIES[family]
    # Exactly the record's tensors (every expert's, the router, fused qkv/gate_up, Gemma's sandwich norms), bf16,
    # with the source's values: nothing renamed or fused for TensorRT-LLM, whose mappers read transformers' names.
    assert set(checked.tensors) == set(source.shape.expected_tensors())
    stored = _tensors(tmp_path / "ckpt", checked.tensors)
    for name, t in stored.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, source.tensor(name).to(torch.bfloat16)), name
    assert ARCHITECTURES[FACTORY_FAMILIES[family]].target("trtllm").trtllm_architecture == FACTORY_FAMILIES[family]


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("quant", ["fp8", "int4-rtn"])
def test_round_to_nearest_checkpoints_per_family_load_or_are_refused_with_the_reason(
    family: str, quant: str, family_models: dict[str, Path], tmp_path: Path
) -> None:
    """fp8 (FP8 rowwise) and int4-rtn (W4A16_AWQ) load on the dense families with separate projections; the
    fused MoE has neither method, and Phi-3's loader splits its fused Linears without their scales."""
    import torch

    source = open_source(family_models[family])
    q = _rtn(source, quant, tmp_path / "q")
    algo = FORMATS[quant].quant_algo
    if quant not in FAMILY_QUANTS[family]:
        with pytest.raises(InvalidInput) as e:
            _export(source, quant, tmp_path / "ckpt", q)
        assert e.value.code == "QUANT_UNSUPPORTED" and e.value.details["architecture"] == FACTORY_FAMILIES[family]
        why = "fused qkv_proj and gate_up_proj" if family == "phi3" else ("FP8 rowwise" if quant == "fp8" else "int4")
        assert why in e.value.message, e.value.message
        return
    _export(source, quant, tmp_path / "ckpt", q)
    checked = check_checkpoint(tmp_path / "ckpt")
    assert checked.quant_algo == algo
    linears = [t for t in source.shape.tensors() if t.quantizable]
    specs = [s.suffix for s in LINEAR_TENSORS[algo]]
    assert {f"{t.name.removesuffix('.weight')}.{s}" for t in linears for s in specs} <= set(checked.tensors)
    stored = _tensors(tmp_path / "ckpt", checked.tensors)
    for t in linears:  # the quantize stage's values, in the layout TensorRT-LLM's Linear loads
        module = t.name.removesuffix(".weight")
        if quant == "fp8":
            assert torch.equal(stored[t.name].view(torch.uint8), q.tensor(t.name).view(torch.uint8)), t.name
        else:
            want = dequantize(q.scheme, module, {k: q.tensor(k) for k in q.module_tensors(t.name)})
            got = unpack_int4_rows(stored[t.name]).float() * stored[f"{module}.weight_scale"].float().repeat_interleave(
                128, dim=1
            )
            assert torch.equal(got, want), t.name
    for t in source.shape.tensors():  # norms (Gemma's as transformers stores them: TensorRT-LLM adds the 1)
        if not t.quantizable:
            assert torch.equal(stored[t.name], source.tensor(t.name).to(torch.bfloat16)), t.name


def _checkpoint_without(ckpt: Path, drop: str) -> None:
    """Rewrite the shard holding `drop` without it (and the index), as a checkpoint missing that tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(drop)
    with safe_open(str(ckpt / shard), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != drop}  # noqa: SIM118
    save_file(kept, str(ckpt / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.slow
def test_nvfp4_qwen3_moe_checkpoint_quantizes_every_expert_and_keeps_the_router(
    family_models: dict[str, Path], tmp_path: Path
) -> None:
    """The one quantized format TensorRT-LLM's fused MoE loads as kiln writes it: NVFP4, every expert's w1/w3/w2 in
    ModelOpt's names with its gate and up sharing their tensor scales, the router bf16 and in exclude_modules; a
    checkpoint missing one expert's scale is refused, naming it."""
    import torch

    from kiln.quant.calibrated import calibrate, calibration_samples

    model_dir = family_models["qwen3_moe"]
    source = open_source(model_dir)
    scheme = get_scheme("nvfp4-w4a4")
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    cal = calibrate(source, scheme, calibration_samples(model_dir, text, samples=4, seq_len=64))
    (tmp_path / "q").mkdir()
    write_quantized(source, scheme, tmp_path / "q", calibrated=cal)
    q = open_quantized(tmp_path / "q", "nvfp4-w4a4")
    ckpt = tmp_path / "ckpt"
    _export(source, "nvfp4-w4a4", ckpt, q, max_shard_bytes=200_000)
    checked = check_checkpoint(ckpt)
    assert checked.quant_algo == "NVFP4"
    routers = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert checked.exclude_modules == ("lm_head", *routers)
    stored = _tensors(ckpt, checked.tensors)
    for router in routers:
        assert stored[f"{router}.weight"].dtype == torch.bfloat16 and f"{router}.weight_scale" not in stored
    experts = [t for t in source.shape.tensors() if t.expert is not None]
    assert len(experts) == 2 * 8 * 3
    for t in experts:
        module = t.name.removesuffix(".weight")
        assert torch.equal(stored[t.name], q.tensor(f"{module}.weight_packed")), t.name
        assert torch.equal(
            stored[f"{module}.input_scale"], (1.0 / q.tensor(f"{module}.input_global_scale")).reshape(())
        )
        if t.kind == TensorKind.FFN_UP_EXPS:  # TensorRT-LLM asserts each expert's w1 and w3 share them
            gate = module.replace("up_proj", "gate_proj")
            for scale in ("weight_scale_2", "input_scale"):
                assert torch.equal(stored[f"{module}.{scale}"], stored[f"{gate}.{scale}"]), module

    _checkpoint_without(ckpt, "model.layers.1.mlp.experts.5.down_proj.weight_scale_2")
    with pytest.raises(InvalidInput) as e:
        check_checkpoint(ckpt)
    assert e.value.code == "TRTLLM_CHECKPOINT"
    assert "model.layers.1.mlp.experts.5.down_proj.weight_scale_2: NVFP4 needs F32 [], got missing" in e.value.message

    doc = json.loads((ckpt / HF_QUANT_CONFIG).read_text())
    doc["quantization"]["exclude_modules"] = ["lm_head"]
    (ckpt / HF_QUANT_CONFIG).write_text(json.dumps(doc))
    with pytest.raises(InvalidInput, match="exclude_modules must list every router"):
        check_checkpoint(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("quant", ["w4a16-awq", "nvfp4-w4a4"])
def test_calibrated_checkpoints_of_dense_families_validate(
    family: str, quant: str, family_models: dict[str, Path], tmp_path: Path
) -> None:
    from kiln.quant.calibrated import calibrate, calibration_samples

    model_dir = family_models[family]
    source = open_source(model_dir)
    scheme = get_scheme(quant)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    cal = calibrate(source, scheme, calibration_samples(model_dir, text, samples=4, seq_len=64))
    (tmp_path / "q").mkdir()
    write_quantized(source, scheme, tmp_path / "q", calibrated=cal)
    _export(source, quant, tmp_path / "ckpt", open_quantized(tmp_path / "q", quant))
    checked = check_checkpoint(tmp_path / "ckpt")
    assert checked.quant_algo == FORMATS[quant].quant_algo and checked.exclude_modules == ("lm_head",)


def _shape(model_dir: Path, **change: object) -> ModelShape:
    config = {**json.loads((model_dir / "config.json").read_text()), **change}
    return ModelShape.from_config(config)


@pytest.mark.parametrize(
    ("family", "change", "words"),
    [
        ("qwen3_moe", {"norm_topk_prob": False}, ["RoutingMethodType.Renormalize", "norm_topk_prob false"]),
        ("qwen3_moe", {"mlp_only_layers": [1]}, ["every layer", "layers [1] dense"]),
        ("gemma3", {"final_logit_softcapping": 30.0}, ["no attention or final logit softcapping", "=30.0"]),
        ("phi3", {"sliding_window": 64}, ["Phi3Attention", "slides over 64 of its 512 positions"]),
        ("mixtral", {"sliding_window": 64}, ["MixtralAttention", "slides over 64"]),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
            ["Qwen3DecoderLayer", "slides over 64"],
        ),
    ],
)
def test_configs_tensorrt_llm_would_compute_differently_are_refused(
    family: str, change: dict, words: list[str], family_models: dict[str, Path]
) -> None:
    spec = get_target("trtllm")
    spec.check_model(_shape(family_models[family]), {}, "bf16", {})  # the tiny model as made is served
    with pytest.raises(InvalidInput) as e:
        spec.check_model(_shape(family_models[family], **change), {}, "bf16", {})
    assert e.value.code == "TARGET_ARCHITECTURE_UNSUPPORTED"
    for w in words:
        assert w in e.value.message, e.value.message


def test_every_quant_refused_per_family_is_one_kiln_writes_and_moe_refusals_name_the_fused_moe(
    family_models: dict[str, Path],
) -> None:
    spec = get_target("trtllm")
    for family, allowed in FAMILY_QUANTS.items():
        shape = _shape(family_models[family])
        for quant, fmt in FORMATS.items():
            if any(q in allowed for q in (quant, quant.removesuffix("-gptq"))) or fmt.quant_algo is None:
                spec.check_model(shape, {}, quant, {})
                continue
            if quant in ("fp8-kv8", "fp8-block", "w4a16-gptq", "w4a16-awq") and family in ("qwen3", "gemma3"):
                spec.check_model(shape, {}, quant, {})  # same algos as fp8 / int4-rtn
                continue
            with pytest.raises(InvalidInput) as e:
                spec.check_model(shape, {}, quant, {})
            assert e.value.code == "QUANT_UNSUPPORTED", (family, quant)
            if shape.moe is not None:
                assert e.value.details["reason"] == MOE_REFUSED[fmt.quant_algo]
    known = set(ALL_FORMATS[q].quant_algo for q in ALL_FORMATS) - {None}
    for arch in ARCHITECTURES.values():
        assert {algo for algo, _ in arch.target("trtllm").trtllm_refused} <= known, arch.family


def _plan(tmp_path: Path, model_dir: Path, entry: dict) -> list:
    from kiln.pipeline.build import plan
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "heldout.txt").write_text("hello world " * 200)
    recipe = tmp_path / "kiln.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": "m",
                "version": "1",
                "source": str(model_dir),
                "eval": {"text": "heldout.txt"},
                "targets": [entry],
            }
        )
    )
    return plan(load_recipe(recipe, allowed_roots=[model_dir.parent]), open_store(None, tmp_path / "work"))


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_plan_has_a_gpu_eval_per_sku_for_every_family_and_refuses_what_its_experts_cannot_run(
    family: str, family_models: dict[str, Path], tmp_path: Path
) -> None:
    quants = sorted(FAMILY_QUANTS[family] - {"int4-rtn"})
    skus = {"bf16": ["h100", "h200"], "fp8": ["h100", "h200"], "nvfp4-w4a4": ["b200"]}
    entries = [{"target": "trtllm", "quants": [q], "params": {"gpus": {"skus": skus[q]}}} for q in quants]
    for i, entry in enumerate(entries):
        nodes = _plan(tmp_path / str(i), family_models[family], entry)
        quant = entry["quants"][0]
        evals = [n for n in nodes if n.id.startswith("gpu-eval/")]
        assert [n.id for n in evals] == [f"gpu-eval/trtllm-{quant}@{sku}" for sku in skus[quant]]
        assert all(n.params["sku"] in skus[quant] and n.params["tensorrt_llm"] == "1.3.0rc20" for n in evals)
    refused = {"qwen3_moe": "fp8-block", "mixtral": "w4a16-awq", "phi3": "fp8"}.get(family)
    if refused is None:
        return
    with pytest.raises(InvalidInput) as e:
        _plan(tmp_path / "refused", family_models[family], {"target": "trtllm", "quants": [refused]})
    assert e.value.code == "QUANT_UNSUPPORTED" and f"trtllm-{refused} cannot serve" in e.value.message


@pytest.mark.parametrize(
    ("family", "converter"), [("mixtral", "llama"), ("gemma3", "gemma"), ("phi3", "phi"), ("qwen3", None)]
)
def test_legacy_engines_use_the_family_converter_or_are_refused(
    family: str, converter: str | None, family_models: dict[str, Path], tmp_path: Path
) -> None:
    entry = {"target": "trtllm", "quants": ["bf16"], "params": {"legacy_engines": {**ENGINES, "skus": ["h100"]}}}
    if converter is None:
        with pytest.raises(InvalidInput) as e:
            _plan(tmp_path, family_models[family], entry)
        assert e.value.code == "ENGINE_UNSUPPORTED" and "#5450" in e.value.message
        return
    (engine,) = [n for n in _plan(tmp_path, family_models[family], entry) if n.id.startswith("engine/")]
    convert = engine.params["commands"][0]
    assert convert[1] == f"{{examples}}/models/core/{converter}/convert_checkpoint.py"
    # Gemma's converter takes its own flags (examples/models/core/gemma/README.md).
    paths = ["--model-dir", "{source}", "--output-model-dir"] if family == "gemma3" else ["--model_dir", "{source}"]
    assert all(p in convert for p in paths), convert
