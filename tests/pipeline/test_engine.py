"""TensorRT-LLM per SKU: the GPU eval of each checkpoint (the default) and opt-in legacy engines, their exact
commands, their deferral to a runner with that SKU where this machine lacks tensorrt_llm or the GPU, and
what `kiln plan`, `kiln build --json` and the registry show."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.core.hardware import PROFILES
from kiln.core.manifest import FileEntry
from kiln.pipeline.records import DerivedParams
from kiln.pipeline.report import PlanRow
from kiln.pipeline.stage import StageOutput
from kiln.pipeline.stages.derived import artifact_record
from kiln.pipeline.stages.publish import manifest_for
from kiln.targets.trtllm.engines import EngineMatrix, gpus_matching, legacy_commands, missing_for
from kiln.targets.trtllm.stages import engine_artifact, filled
from tests.model_factory import make_model

MATRIX = EngineMatrix(skus=["h100", "a100"], max_batch_size=8, max_input_len=256, max_seq_len=512)
LIMITS = ["--max_batch_size", "8", "--max_input_len", "256", "--max_seq_len", "512"]
BUILD = ["trtllm-build", "--checkpoint_dir", "{checkpoint}", "--output_dir", "{engine}", *LIMITS]
COMMON = ["--gpt_attention_plugin", "auto", "--kv_cache_type", "paged"]
QUANTIZE = ["python3", "{examples}/quantization/quantize.py", "--model_dir", "{source}", "--dtype", "bfloat16"]
OUT = ["--output_dir", "{checkpoint}", "--tp_size", "1"]
# This machine has neither tensorrt_llm nor an NVIDIA GPU; where one has both, these tests say nothing.
NO_RUNNER_HERE = importlib.util.find_spec("tensorrt_llm") is None or shutil.which("nvidia-smi") is None
needs_no_runner = pytest.mark.skipif(not NO_RUNNER_HERE, reason="this machine can build engines")


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize(
    ("quant", "sku", "converter", "convert", "flags"),
    [
        (
            "bf16",
            "h100",
            "llama",
            ["python3", "{examples}/models/core/llama/convert_checkpoint.py", "--model_dir", "{source}"]
            + ["--output_dir", "{checkpoint}", "--dtype", "bfloat16", "--tp_size", "1"],
            ["--gemm_plugin", "bfloat16"],
        ),
        (  # Gemma's converter takes its own flags (examples/models/core/gemma/README.md)
            "bf16",
            "h100",
            "gemma",
            ["python3", "{examples}/models/core/gemma/convert_checkpoint.py", "--ckpt-type", "hf", "--model-dir"]
            + ["{source}", "--output-model-dir", "{checkpoint}", "--dtype", "bfloat16", "--world-size", "1"],
            ["--gemm_plugin", "bfloat16"],
        ),
        (
            "fp8",
            "h100",
            "llama",
            [*QUANTIZE, "--qformat", "fp8", "--kv_cache_dtype", "fp8", "--calib_size", "512", *OUT],
            ["--gemm_plugin", "auto", "--use_fp8_context_fmha", "enable"],
        ),
        (
            "w4a16-awq",
            "a100",
            "qwen",
            [*QUANTIZE, "--qformat", "int4_awq", "--awq_block_size", "128", "--calib_size", "32", *OUT],
            ["--gemm_plugin", "auto"],
        ),
    ],
)
def test_legacy_engine_commands_are_exact(
    quant: str, sku: str, converter: str, convert: list[str], flags: list[str]
) -> None:
    """From the bf16 source with the pinned release's own converters (the family's), then trtllm-build."""
    assert legacy_commands(quant, sku, MATRIX, converter) == [convert, [*BUILD, *COMMON, *flags]]


def test_nvidia_smi_names_match_their_sku_only() -> None:
    smi = "NVIDIA A100-SXM4-80GB\nNVIDIA H100 80GB HBM3\nNVIDIA GH200 480GB\n"
    assert gpus_matching(smi, "a100") == ["NVIDIA A100-SXM4-80GB"]
    assert gpus_matching(smi, "h100") == ["NVIDIA H100 80GB HBM3"]
    assert gpus_matching(smi, "h200") == []  # a GH200 is not an H200
    assert gpus_matching("NVIDIA L40S\n", "l40s") == ["NVIDIA L40S"]


@needs_no_runner
def test_this_machine_lacks_what_a_gpu_stage_needs() -> None:
    for engine in (False, True):
        missing = missing_for("h100", "1.3.0rc20", engine=engine)
        if importlib.util.find_spec("tensorrt_llm") is None:
            assert "tensorrt_llm is not importable" in missing
        if shutil.which("nvidia-smi") is None:
            assert "nvidia-smi is not on PATH (no NVIDIA GPU)" in missing
        assert ("trtllm-build is not on PATH" in missing) == engine


def test_a_built_engine_is_offered_to_its_sku_alone() -> None:
    params = {
        "artifact": "trtllm-fp8-h100",
        "quant": "fp8",
        "sku": "h100",
        "limits": {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512},
        "tensorrt_llm": "0.21.0",
        "commands": legacy_commands("fp8", "h100", MATRIX, "llama"),
    }
    made = engine_artifact(params, {"tensorrt": "10.11.0", "tensorrt_llm": "0.21.0"}, ["rank0.engine"])
    result = artifact_record(DerivedParams.model_validate(params), made)
    output = StageOutput(
        "engine/trtllm-fp8-h100", "k", Path("."), result, [FileEntry(path="rank0.engine", sha256="0" * 64, size=1)], {}
    )
    manifest = manifest_for(output)
    assert manifest.hardware == ["h100"] and manifest.format == "trtllm-engine"
    assert set(manifest.unsupported) == set(PROFILES) - {"h100"}
    assert "engines run on that SKU only" in manifest.unsupported["h200"]  # same sm90, still not offered
    runtime = manifest.runtime
    assert (runtime["sku"], runtime["compute_capability"], runtime["tensorrt"]) == ("h100", 90, "10.11.0")
    assert runtime["tensorrt_llm"] == "0.21.0" and runtime["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    # Quantized by that release on the runner, from the bf16 source: not kiln's quantize stage's values.
    assert (
        "quantize.py (ModelOpt), on the runner" in runtime["quantized_by"]
        and runtime["built_from"] == "the bf16 source"
    )
    commands = filled(params["commands"], {"{examples}": "/opt/trt/examples", "{source}": "/s"})
    assert commands[0][1] == "/opt/trt/examples/quantization/quantize.py" and commands[0][3] == "/s"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recipe")
    make_model(root / "model", hidden_size=128, intermediate_size=256, num_kv_heads=4)
    (root / "heldout.txt").write_text("def f(x):\n    return [x, x + 1, str(x)]\n" * 60)
    doc = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt", "max_tokens": 128, "window": 64, "greedy_prompts": 1, "greedy_tokens": 4},
        "targets": [
            {
                "target": "trtllm",
                "quants": ["bf16"],
                "params": {
                    "gpus": {"skus": ["h100", "a100"]},
                    "legacy_engines": {"skus": ["a100"], "max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512},
                },
            },
            {"target": "trtllm", "quants": ["int4-rtn"], "params": {"gpus": {"skus": ["h100", "a100"]}}},
        ],
    }
    (root / "kiln.yaml").write_text(yaml.safe_dump(doc))
    return root / "kiln.yaml"


@needs_no_runner
def test_build_plan_and_publish_show_gpu_stages_deferred_to_their_runner(recipe: Path, tmp_path: Path) -> None:
    work = str(tmp_path / "work")
    out = kiln("build", str(recipe), "--json", "--work-dir", work)
    assert out.returncode == 0, out.stderr  # deferred is not a failure
    summary = json.loads(out.stdout)
    rows = {r["artifact"]: r for r in summary["artifacts"]}
    assert rows["trtllm-bf16"]["eval"] == "passed"
    int4 = rows["trtllm-int4-rtn"]
    assert int4["export"] == "built" and int4["eval"] == "not_evaluated" and "GPU runner" in int4["reason"]
    engine = rows["trtllm-bf16-a100"]  # the legacy engine: an artifact of its own, deferred
    assert (engine["export"], engine["eval"], engine["path"]) == ("deferred", "deferred", None)
    assert engine["runner"] == "a100 GPU with tensorrt_llm==0.21.0"
    assert engine["command"] == legacy_commands("bf16", "a100", MATRIX, "llama")
    deferred = {d["node"]: d for d in summary["deferred"]}
    gpu_evals = {f"gpu-eval/trtllm-{q}@{s}" for q in ("bf16", "int4-rtn") for s in ("h100", "a100")}
    assert set(deferred) == gpu_evals | {"engine/trtllm-bf16-a100"}
    h100 = deferred["gpu-eval/trtllm-bf16@h100"]
    assert h100["sku"] == "h100" and h100["compute_capability"] == 90 and h100["missing"]
    assert h100["runner"] == "h100 GPU with tensorrt_llm==1.3.0rc20"
    assert "$TRTLLM_EXAMPLES" in " ".join(deferred["engine/trtllm-bf16-a100"]["missing"])
    assert summary["stages"]["deferred"] == 5
    report = json.loads((tmp_path / "reports" / "m-1.json").read_text())
    assert report["deferred"] == summary["deferred"]
    text = kiln("build", str(recipe), "--work-dir", work).stderr.replace("\n", " ")
    assert "deferred engine/trtllm-bf16-a100 to a runner with a100 GPU with tensorrt_llm==0.21.0" in text

    plan = json.loads(kiln("plan", str(recipe), "--json", "--work-dir", work).stdout)
    # Each row is a PlanRow's dump: a deferred one with what its stage's deferral says, others without those keys.
    assert [PlanRow.model_validate(r).model_dump(mode="json") for r in plan] == plan
    states = {r["node"]: r for r in plan}
    assert states["export/trtllm-int4-rtn"]["state"] == "cached"
    gpu = states["gpu-eval/trtllm-int4-rtn@a100"]
    assert gpu["state"] == "deferred" and gpu["runner"] == "a100 GPU with tensorrt_llm==1.3.0rc20"
    assert gpu["inputs"] == {"reference": "reference/source", "export": "export/trtllm-int4-rtn"}
    assert (
        gpu["requires"]["accelerator"] == "nvidia:a100" and gpu["requires"]["runtime_env"] == "tensorrt_llm==1.3.0rc20"
    )
    assert states["engine/trtllm-bf16-a100"]["inputs"] == {"ingest": "ingest/source"}  # from the bf16 source
    assert "deferred to h100 GPU with" in kiln("plan", str(recipe), "--work-dir", work).stderr.replace("\n", " ")

    registry = tmp_path / "registry"
    out = kiln("publish", str(recipe), "--json", "--work-dir", work, "--registry", str(registry))
    assert out.returncode == 0, out.stderr
    published = {r["artifact"]: r["published"] for r in json.loads(out.stdout)["artifacts"]}
    assert published["trtllm-int4-rtn"] == "ran" and published["trtllm-bf16-a100"] == "deferred"
    from kiln.client import RegistryClient

    with RegistryClient.connect(registry) as client:
        release = client.get_release("m", "1")
    artifacts = {a.name: a for a in release.artifacts}
    assert set(artifacts) == {"trtllm-bf16", "trtllm-int4-rtn"}  # no engine from here
    # The release plans what this build can make, and is sealed without the deferred engine; the GPU evals
    # still waiting for their runners hold nothing back.
    assert release.status == "sealed"
    assert release.planned_artifacts == ["trtllm-bf16", "trtllm-int4-rtn"]
    int4_eval = artifacts["trtllm-int4-rtn"].evals[0]
    assert (int4_eval.runtime, int4_eval.status) == ("tensorrt_llm", "not_evaluated")
    assert "GPU runner" in (int4_eval.reason or "") and artifacts["trtllm-int4-rtn"].eval_status == "not_evaluated"
    assert artifacts["trtllm-int4-rtn"].hardware == ["a100", "l40s", "h100", "h200"]
