"""Compute stages run on the device they are given: `--device` for local builds and `kiln run-stage`.

The reference, calibrated quantization and the transformers / JAX / vLLM evals are placed on the build's
device (its kind in their keys and params, a GPU in their requirements); the device, its name and
memory are recorded in each one's provenance. Here there is no GPU: `--device cuda` must be refused
before anything runs, and `--device cpu` is what every other test builds with.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.core.device import CPU, Device, cpu_model
from kiln.eval.runtimes.environments import get_environment
from kiln.pipeline import build
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.store import WorkDir
from tests.model_factory import make_model

QUANTS = ("bf16", "int8-w8a8", "w4a16-gptq", "f16")
LOOSE = {"max_kl": 100.0, "min_top1": 0.0, "max_ppl_increase": 100.0, "min_greedy_match": 0.0}


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("placed")
    make_model(root / "model", hidden_size=128, intermediate_size=256, num_kv_heads=4)
    (root / "heldout.txt").write_text((Path(__file__).parents[1] / "model_factory.py").read_text() * 2)
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        # A random model: the gates are not what is tested here.
        "eval": {"text": "heldout.txt", "max_tokens": 256, "window": 128, "gates": dict.fromkeys(QUANTS, LOOSE)},
        "targets": [
            {"target": "hf-bundle", "quants": ["bf16", "int8-w8a8", "w4a16-gptq"]},
            {"target": "gguf", "quants": ["f16"]},
            {"target": "orbax", "quants": ["bf16"]},
        ],
        "calibration": {"samples": 2, "seq_len": 32},
    }
    (root / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    return root / "kiln.yaml"


def test_a_graph_placed_on_a_gpu_puts_only_its_compute_stages_there(recipe_path: Path, tmp_path: Path) -> None:
    recipe = load_recipe(recipe_path)
    store = WorkDir(tmp_path / "work")
    on_cpu = {n.id: n for n in build.plan(recipe, store)}
    on_gpu = {n.id: n for n in build.plan(recipe, store, device=Device("cuda", 1))}
    # vLLM's evals are placed too, sized as a serving runtime for the plan's device: a GPU of unknown memory
    # here (none is visible), so one each (pipeline.requirements.tensor_parallel).
    served = {"eval/hf-bundle-bf16@vllm", "eval/hf-bundle-int8-w8a8@vllm", "eval/hf-bundle-w4a16-gptq@vllm"}
    compute = {
        "reference/source",
        "quantize/w4a16-gptq",
        "eval/hf-bundle-bf16",
        "eval/hf-bundle-int8-w8a8",
        "eval/hf-bundle-w4a16-gptq",
        "eval/orbax-bf16",
        *served,
    }
    assert {i for i, n in on_gpu.items() if n.requires.gpus == 1} == compute
    assert all(n.requires.gpus == 0 and n.requires.device == "cpu" for n in on_cpu.values())
    # On the CPU vLLM's eval is keyed by this CPU's verdict; on a GPU by the CUDA build's environment, in
    # which it runs there (eval.runtimes.environments), and not by the CPU's flags.
    cuda_env = get_environment("vllm-cuda")
    for node_id in served:
        assert "capabilities" in on_cpu[node_id].params and "capabilities" not in on_gpu[node_id].params
        assert on_gpu[node_id].params["environment"] == cuda_env.digest()
        assert on_gpu[node_id].requires.runtime_env == "vllm==0.32.0"
    for node_id in compute:
        assert on_cpu[node_id].params["device"] == "cpu" and on_gpu[node_id].params["device"] == "cuda"
        assert on_gpu[node_id].args["device"] == "cuda:1"  # the index is where to run, not what is made
    # A GPU's output is another stage output: its key differs from the CPU's, and not with the GPU's index.
    ingest = {"ingest/source": "0" * 64}
    ref_cpu, ref_gpu = on_cpu["reference/source"], on_gpu["reference/source"]
    assert ref_cpu.cache_key(ingest) != ref_gpu.cache_key(ingest)
    assert ref_gpu.cache_key(ingest) == build.plan(recipe, store, device=Device("cuda"))[1].cache_key(ingest)
    # GPU calibration computes in bf16 whatever this CPU does (it is in the key and the record).
    assert on_gpu["quantize/w4a16-gptq"].params["calibration"]["compute_dtype"] == "bfloat16"
    # Round-to-nearest, exports and llama.cpp's eval compute where they always did: the same nodes.
    for node_id in ("quantize/int8-w8a8", "export/hf-bundle-int8-w8a8", "export/gguf-f16", "eval/gguf-f16"):
        assert on_cpu[node_id].params == on_gpu[node_id].params and "device" not in on_gpu[node_id].params


def test_a_local_build_on_the_cpu_records_the_device_in_each_compute_stage(recipe_path: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    out = kiln("build", str(recipe_path), "--device", "cpu", "--json", "--work-dir", str(work))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["failed_gates"] == []
    stages = {}
    for meta in work.glob("*/*/stage.json"):
        data = json.loads(meta.read_text())
        stages[data["node"]] = data
    for node_id in ("reference/source", "quantize/w4a16-gptq", "eval/hf-bundle-int8-w8a8", "eval/orbax-bf16"):
        device = stages[node_id]["provenance"]["device"]
        assert device["device"] == "cpu" and device["name"] == cpu_model() and device["memory_bytes"] > 0, node_id
        assert stages[node_id]["provenance"]["params"]["device"] == "cpu"
    for node_id in ("ingest/source", "quantize/int8-w8a8", "export/gguf-f16", "eval/gguf-f16"):
        assert "device" not in stages[node_id]["provenance"], node_id
    assert stages["reference/source"]["result"]["params"]["device"] == "cpu"
    assert stages["reference/source"]["result"]["dtype"] == "float32"
    assert (
        stages["quantize/w4a16-gptq"]["result"]["calibration"]
        == stages["quantize/w4a16-gptq"]["provenance"]["params"]["calibration"]
    )
    assert "on cpu" in stages["eval/orbax-bf16"]["result"]["runtime_version"]  # JAX's platform, explicit
    # `auto` on a machine without a GPU is the CPU: the same graph, every stage cached.
    again = kiln("build", str(recipe_path), "--device", "auto", "--json", "--work-dir", str(work))
    assert again.returncode == 0, again.stderr[-3000:]
    assert set(json.loads(again.stdout)["stages"]) == {"cached"}


@pytest.mark.parametrize(
    ("command", "device", "code"),
    [
        ("build", "cuda", "DEVICE_UNAVAILABLE"),
        ("build", "cuda:1", "DEVICE_UNAVAILABLE"),
        ("build", "cuda:x", "INVALID_DEVICE"),
        ("run-stage", "cuda", "DEVICE_UNAVAILABLE"),
        ("publish", "gpu", "INVALID_DEVICE"),
    ],
)
def test_a_device_this_machine_lacks_exits_2_before_anything_runs(
    recipe_path: Path, tmp_path: Path, command: str, device: str, code: str
) -> None:
    if build_has_gpu():
        pytest.skip("this machine has a CUDA device")
    work = tmp_path / "work"
    args = [command, str(recipe_path), *(["reference/source"] if command == "run-stage" else [])]
    out = kiln(*args, "--device", device, "--json", "--work-dir", str(work))
    assert out.returncode == 2, out.stderr
    assert json.loads(out.stdout)["error"]["code"] == code
    assert device in out.stderr
    assert not (work / "reference").exists() and not (work / "ingest").exists()


def build_has_gpu() -> bool:
    from kiln.core.device import cuda_device_count

    return cuda_device_count() > 0


def test_the_device_of_a_plan_defaults_to_the_cpu(recipe_path: Path, tmp_path: Path) -> None:
    recipe = load_recipe(recipe_path)
    store = WorkDir(tmp_path / "work")
    default = build.plan(recipe, store)
    assert [n.params for n in default] == [n.params for n in build.plan(recipe, store, device=CPU)]
