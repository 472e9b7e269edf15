"""hf-bundle: bf16 and compressed-tensors bundles that transformers loads on CPU, with per-scheme hardware."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.formats.hf_model import open_source
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.records import ArtifactRecord
from kiln.pipeline.stage import Node
from kiln.pipeline.stages import export as export_stage
from kiln.pipeline.stages import ingest as ingest_stage
from kiln.pipeline.stages import quantize as quantize_stage
from kiln.pipeline.store import WorkDir
from kiln.quant.catalog import SCHEMES, get_scheme
from kiln.quant.store import open_quantized, write_quantized
from kiln.targets.base import ExportRequest, get_target
from kiln.targets.hf_bundle.export import export
from tests.model_factory import make_model

QUANTIZED = ["fp8", "fp8-block", "int8-w8a8", "int8-w8a16", "int4-rtn"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 128 / intermediate 256, 4 kv heads of 32: every Linear is whole 128x128 blocks (fp8-block, int4 groups).
    return make_model(tmp_path_factory.mktemp("llama128"), hidden_size=128, intermediate_size=256, num_kv_heads=4)


@pytest.fixture(scope="module")
def reference_logits(model_dir: Path):
    return _logits(model_dir)


def _logits(path: Path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.arange(0, 500, 7).unsqueeze(0)
    with torch.inference_mode():
        return model(input_ids=ids).logits[0]


def _bundle(model_dir: Path, tmp_path: Path, scheme: str, **params: int) -> Path:
    source = open_source(model_dir)
    quantized = None
    if get_scheme(scheme).quantized:
        (tmp_path / "q").mkdir()
        write_quantized(source, get_scheme(scheme), tmp_path / "q")
        quantized = open_quantized(tmp_path / "q", scheme)
    out = tmp_path / "bundle"
    out.mkdir()
    export(source, ExportRequest(quant=scheme, out_dir=out, params=dict(params), quantized=quantized))
    return out


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_quantized_bundle_loads_in_transformers_on_cpu(
    scheme: str, model_dir: Path, tmp_path: Path, reference_logits
) -> None:
    import torch

    bundle = _bundle(model_dir, tmp_path, scheme)
    qc = json.loads((bundle / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == get_scheme(scheme).format
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and qc["ignore"] == ["lm_head"]
    assert (group["input_activations"] is not None) == (get_scheme(scheme).input_activations is not None)

    # transformers 5.17 loads compressed and compressed-tensors decompresses on the first forward pass
    # (no `run_compressed=False` / `dequantize=True` needed on CPU); W8A8 activations are quantized at run time.
    logits = _logits(bundle)
    ref = reference_logits
    rel = (logits - ref).norm() / ref.norm()
    bounds = {"fp8": 0.1, "fp8-block": 0.1, "int8-w8a8": 0.05, "int8-w8a16": 0.02, "int4-rtn": 0.3}
    assert float(rel) < bounds[scheme]
    top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    assert top1 >= {"fp8": 0.8, "fp8-block": 0.8, "int8-w8a8": 0.85, "int8-w8a16": 0.9, "int4-rtn": 0.6}[scheme]
    assert torch.isfinite(logits).all()


def test_quantized_bundle_is_smaller_and_keeps_head_and_norms_bf16(model_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    bundle = _bundle(model_dir, tmp_path, "int4-rtn")
    with safe_open(str(bundle / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert str(f.get_slice("lm_head.weight").get_dtype()) == "BF16"
        assert str(f.get_slice("model.norm.weight").get_dtype()) == "BF16"
    assert "model.layers.0.self_attn.q_proj.weight_packed" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    src = (model_dir / "model.safetensors").stat().st_size
    assert (bundle / "model.safetensors").stat().st_size < src


def test_sharded_quantized_bundle_loads(model_dir: Path, tmp_path: Path, reference_logits) -> None:
    bundle = _bundle(model_dir, tmp_path, "int8-w8a16", max_shard_bytes=150_000)
    index = json.loads((bundle / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.1.mlp.down_proj.weight_scale" in index["weight_map"]
    logits = _logits(bundle)
    assert float((logits.argmax(-1) == reference_logits.argmax(-1)).float().mean()) >= 0.9


def test_export_refuses_missing_or_mismatched_quantized_input(model_dir: Path, tmp_path: Path) -> None:
    from kiln.core.errors import InvalidInput

    source = open_source(model_dir)
    with pytest.raises(InvalidInput, match="quantize stage"):
        export(source, ExportRequest(quant="fp8", out_dir=tmp_path))
    (tmp_path / "q").mkdir()
    write_quantized(source, get_scheme("int8-w8a16"), tmp_path / "q")
    with pytest.raises(InvalidInput):
        wrong = open_quantized(tmp_path / "q", "int8-w8a16")
        export(source, ExportRequest(quant="fp8", out_dir=tmp_path, quantized=wrong))


def test_stages_record_per_artifact_hardware_with_reasons(model_dir: Path, tmp_path: Path) -> None:
    spec = get_target("hf-bundle")
    # Every scheme but the source's and the release layouts (mxfp4-experts: the release's bytes, kept by the export).
    assert spec.quantized_input == tuple(name for name in SCHEMES if name not in ("bf16", "mxfp4-experts"))
    ingest = ingest_stage.node(open_source(model_dir), model_dir, tmp_path / "hashes.json")
    quantize = Node(
        "quantize/fp8",
        quantize_stage.STAGE,
        params={"scheme": get_scheme("fp8").model_dump()},
        inputs={"ingest": ingest.id},
    )
    nodes = [ingest, quantize]
    for quant in ("bf16", "fp8"):
        nodes.append(
            Node(
                f"export/hf-bundle-{quant}",
                export_stage.STAGE,
                params={
                    "artifact": f"hf-bundle-{quant}",
                    "model": "m",
                    "target": spec.name,
                    "target_code_version": spec.code_version,
                    "quant": quant,
                    "params": {},
                    "hardware": None,
                },
                inputs={"ingest": ingest.id, "quantized": quantize.id} if quant == "fp8" else {"ingest": ingest.id},
            )
        )
    out = LocalExecutor(WorkDir(tmp_path / "work")).run(nodes)
    fp8 = out["export/hf-bundle-fp8"].output
    bf16 = out["export/hf-bundle-bf16"].output
    assert fp8 is not None and bf16 is not None
    fp8_record, bf16_record = fp8.record(ArtifactRecord), bf16.record(ArtifactRecord)
    assert "a100" not in fp8_record.hardware and "h100" in fp8_record.hardware
    assert "a100" in bf16_record.hardware
    reasons = fp8_record.details["hardware"]
    assert reasons["a100"]["compatible"] is False and "sm89" in reasons["a100"]["reason"]
    assert "e4m3fnuz" in reasons["mi300x"]["reason"]
    assert fp8_record.runtime["quantization"]["format"] == "float-quantized"
    # What resolve's 404 names: the capability the hardware lacks.
    assert "sm89" in fp8_record.unsupported["a100"] and "tpu-v5e" in fp8_record.unsupported
    assert "h100" not in fp8_record.unsupported and "a100" not in bf16_record.unsupported
