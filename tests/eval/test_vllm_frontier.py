"""vLLM's CPU build on DeepSeek-V3 and gpt-oss: a bf16 bundle of each, made confident (`sharpen`) so that a wrong
sink, window, rope or expert would show, scores in vLLM as the float32 reference does; what its CPU build cannot
run of DeepSeek-V3's MLA (`vllm_support.mla_cpu_limitation`) is recorded not evaluated with the reason.

DeepSeek-V3 is made with DeepSeek's latent (kv_lora_rank 512 + qk_rope_head_dim 64, the only one vLLM's CPU MLA
kernel takes) and YaRN as DeepSeek's releases set it; transformers writes neither its sigmoid routing nor its
correction bias into config.json, which vLLM reads (`implied_config`): the bundle carries them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.eval.gates import gate_for
from kiln.eval.run import evaluate_artifact
from kiln.eval.runtimes import CachedRuntime, TransformersRuntime
from kiln.eval.runtimes.capabilities import vllm_capabilities
from kiln.eval.runtimes.vllm_support import (
    architecture_limitation,
    bundle_config,
    bundle_expert_schemes,
    bundle_schemes,
    mla_cpu_limitation,
)
from kiln.eval.text import EvalText, tokenize_text
from tests.model_factory import make_bundle, make_model, sharpen
from tests.quantized_sources import make_mxfp4_source

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 128,
}
DEEPSEEK_LATENT: dict[str, Any] = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Two dense-then-sparse layers: 8 experts top-2 in 2 groups beside a shared expert, every width a multiple of 32
    # (vLLM's CPU experts kernels).
    "deepseek_v3": (
        "deepseek_v3",
        {**DEEPSEEK_LATENT, "q_lora_rank": 64, "moe_intermediate_size": 64, "rope_parameters": YARN},
    ),
    # The same with one q_proj (no query latent).
    "deepseek_v3-no-q-latent": (
        "deepseek_v3",
        {**DEEPSEEK_LATENT, "q_lora_rank": None, "moe_intermediate_size": 64, "rope_parameters": YARN},
    ),
    # Sliding (16 tokens) and full layers alternating, sinks, 4 experts top-2 with biases, YaRN (its default).
    "gpt_oss": ("gpt_oss", {"head_dim": 32, "intermediate_size": 128, "num_kv_heads": 2}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            family, config = MODELS[name]
            out = tmp_path_factory.mktemp(name) / name
            made[name] = make_model(out, family, hidden_size=128, num_heads=4, **config)
            sharpen(made[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def text(models: Callable[[str], Path]) -> EvalText:
    body = Path(os.__file__).with_name("argparse.py").read_text()  # every model shares the tokenizer
    return tokenize_text(
        models("gpt_oss"), body, window=96, max_tokens=384, prompts=4, prompt_tokens=12, greedy_tokens=12
    )


@pytest.fixture(scope="module")
def references(models: Callable[[str], Path]) -> Iterator[Callable[[str], CachedRuntime]]:
    opened: dict[str, CachedRuntime] = {}

    def get(name: str) -> CachedRuntime:
        if name not in opened:
            opened[name] = CachedRuntime(TransformersRuntime(models(name)))
        return opened[name]

    yield get
    for rt in opened.values():
        rt.close()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_bf16_bundle_of_each_scores_in_vllm_as_the_reference(
    models: Callable[[str], Path],
    references: Callable[[str], CachedRuntime],
    text: EvalText,
    tmp_path: Path,
    name: str,
) -> None:
    bundle = make_bundle(models(name), tmp_path, "bf16")
    config = bundle_config(bundle)
    if name.startswith("deepseek"):  # the routing transformers computes, said where vLLM reads it
        assert (config["scoring_func"], config["topk_method"], config["moe_layer_freq"]) == ("sigmoid", "noaux_tc", 1)
    assert mla_cpu_limitation(config) is None
    report = evaluate_artifact(references(name), "vllm", bundle, text, gate_for("bf16"))
    # The same weights in float32 arithmetic as the reference's: sinks, windows, MLA and routing included, only the
    # kernels differ. Measured: KL 1e-9 (gpt-oss) and 9e-9 (DeepSeek-V3), every top and greedy token equal.
    assert report.status == "passed", (report.reason, report.failures)
    assert report.metrics is not None and report.metrics.kl < 1e-6 and report.metrics.top1 > 0.999
    assert (report.runtime_version or "").endswith("float32 activations, 2 threads")


def test_mla_that_vllms_cpu_build_does_not_run_is_not_evaluated(tmp_path: Path, text: EvalText) -> None:
    # transformers' own tiny latent (16 + 8): vLLM's CPU MLA kernel would refuse it as its first step runs.
    small = make_model(tmp_path / "small", "deepseek_v3", hidden_size=128, num_heads=4)
    why = mla_cpu_limitation(bundle_config(small))
    assert why is not None and "takes a latent of 576" in why and "this model's is 24 (16 + 8)" in why
    report = evaluate_artifact(None, "vllm", small, text, gate_for("bf16"))  # type: ignore[arg-type]
    assert report.status == "not_evaluated" and report.runtime_needed == "vllm"
    assert report.reason is not None and "takes a latent of 576" in report.reason

    # DeepSeek's latent with an unscaled rope: vLLM's CPU build computes it otherwise than transformers.
    unscaled = make_model(tmp_path / "unscaled", "deepseek_v3", hidden_size=128, num_heads=4, **DEEPSEEK_LATENT)
    why = mla_cpu_limitation(bundle_config(unscaled))
    assert why is not None and "unscaled rope" in why
    assert mla_cpu_limitation({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": "x"}) is None  # vLLM decides


def test_a_quantized_gpt_oss_bundle_is_not_evaluated_in_vllm(
    models: Callable[[str], Path], references: Callable[[str], CachedRuntime], text: EvalText, tmp_path: Path
) -> None:
    # Its attention FP8, its stacked experts bf16 (no scheme quantizes them): vLLM's gpt-oss model, given the
    # compressed-tensors config, builds experts without their biases and its load fails.
    bundle = make_bundle(models("gpt_oss"), tmp_path, "fp8")
    why = architecture_limitation(bundle_config(bundle))
    assert why is not None and "w2_bias" in why
    report = evaluate_artifact(references("gpt_oss"), "vllm", bundle, text, gate_for("fp8"))
    assert report.status == "not_evaluated" and report.runtime_needed == "vllm"
    assert report.reason is not None and "stacked experts stay bf16" in report.reason


def test_an_mxfp4_experts_bundle_meets_vllms_cpu_experts_limit(tmp_path: Path, text: EvalText) -> None:
    """gpt-oss in its release layout (hf-bundle-mxfp4-experts: `quant_method: mxfp4`) is no compressed-tensors
    bundle: vLLM's gpt-oss loads its experts as released (`_load_weights_mxfp4`), its Linears are bf16, and what
    decides on a CPU is its MXFP4 experts kernel, which needs AMX (CPUExpertsMxfp4)."""
    bundle = make_mxfp4_source(tmp_path / "bundle", hidden_size=64, intermediate_size=64, head_dim=32)
    config = bundle_config(bundle)
    assert architecture_limitation(config) is None
    [experts] = bundle_expert_schemes(config)
    assert bundle_schemes(config) == [] and (experts.weight_bits, experts.group_size, experts.activations) == (
        4,
        32,
        False,
    )
    if vllm_capabilities().amx.used:
        pytest.skip("this CPU has AMX: vLLM's CPUExpertsMxfp4 runs the bundle")
    report = evaluate_artifact(None, "vllm", bundle, text, gate_for("mxfp4-experts"))  # type: ignore[arg-type]
    assert report.status == "not_evaluated" and report.runtime_needed == "vllm"
    assert report.reason is not None and "MXFP4 experts: vLLM runs MXFP4 experts on CPU with AMX only" in report.reason
