"""vLLM's CPU build on the families of 2025-26 (Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3): each one's bf16 bundle
scores as the float32 reference does; a quantized bundle of each dense family scores as transformers scores it;
what vLLM's CPU build cannot run of a mixture's experts (`vllm_support.CPU_EXPERTS_LIMITS`) is recorded not
evaluated, with a reason that is the one vLLM's own load refuses it with here, and what it runs is scored as
transformers scores it. A load vLLM refuses leaves the worker able to load the next model.

Each tiny model exercises what its family adds (as tests/eval/test_families_transformers.py): Qwen3-MoE a dense
layer among sparse ones, Mixtral a sliding window shorter than a window, Gemma 3 sliding and global layers and
both soft-caps, Phi-3 its fused projections; all 128 wide with heads of 32 (vLLM's CPU attention takes 32), so
every Linear holds whole int4 groups and FP8 blocks. The bf16 bundles are of the models made confident
(`sharpen`), so a misplaced norm, window or expert would show; the quantized ones of the models as drawn, whose
near-uniform predictions a one-step rounding difference barely moves."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.eval.gates import gate_for
from kiln.eval.metrics import log_softmax
from kiln.eval.run import evaluate_artifact
from kiln.eval.runtimes import CachedRuntime, TransformersRuntime
from kiln.eval.runtimes.capabilities import AmxVerdict, decide, vllm_capabilities
from kiln.eval.runtimes.environments import find, get_environment
from kiln.eval.runtimes.vllm_runtime import VllmRuntime, WorkerError, shared_worker
from kiln.eval.runtimes.vllm_support import (
    CPU_EXPERTS_LIMITS,
    ExpertsShape,
    WeightScheme,
    bundle_config,
    bundle_experts,
    bundle_schemes,
    cpu_limitation,
    experts_stand_ins,
    head_size,
)
from kiln.eval.text import EvalText, tokenize_text
from tests.eval.conftest import installed
from tests.model_factory import NEW_FAMILIES, make_bundle, make_model, sharpen

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "qwen3_moe": {"moe_intermediate_size": 128, "num_layers": 3, "mlp_only_layers": [1]},
    "mixtral": {"intermediate_size": 128, "sliding_window": 16},
    "gemma3": {
        "num_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "phi3": {},
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
# One quantized scheme per dense family, each through another of vLLM's CPU kernels: torch's FP8 matmul, the
# 4-bit weight-only GEMM (bf16 activations), oneDNN's int8 GEMM.
DENSE_SCHEMES = {"qwen3": "fp8", "gemma3": "int4-rtn", "phi3": "int8-w8a8"}
# What vLLM's own load says where it refuses a mixture's bundle on a CPU without AMX (a Linear layer's refusal
# where vLLM meets one before the experts). On a CPU with AMX, the schemes whose experts need only AMX load.
VLLM_REFUSALS = {
    "fp8": "Unsupported FP8 MoE backend: NONE",
    "fp8-block": "requires AMX tile support",
    "int8-w8a8": "No Int8 MoE backend supports the deployment configuration",
    "int8-w8a16": "Quant type (uint8b128) not supported by CPUWNA16",
    "int4-rtn": "No WNA16 MoE backend supports the deployment configuration",
    "nvfp4-w4a16": "Marlin FP4 not available",
    "mxfp4-w4a4": "Failed to find a kernel that can implement the MXFP4 linear layer",
}
MOE_CASES = [("qwen3_moe", s) for s in VLLM_REFUSALS] + [("mixtral", s) for s in ("fp8", "int8-w8a8", "int4-rtn")]
# What an AMD EPYC with AVX-512 decides (no AMX), and one with AMX.
NO_AMX = decide(
    frozenset({"avx2", "avx512f", "avx512_vnni"}),
    installed(get_environment("vllm"), Path("/opt/vllm-env")),
)
WITH_AMX = NO_AMX.model_copy(update={"amx": AmxVerdict(advertised=True, used=True, reason="AMX code ran here")})
HELLO = {"vllm": "0.32.0", "kernels": {"cpu_gemm_wna16": True}}
INT8_W8A8 = WeightScheme("int", 8, "channel", True)
INT4 = WeightScheme("int", 4, "group", False, 128)
FP8_BLOCK = WeightScheme("float", 8, "block", True)


# --- a mixture's experts: what vLLM's CPU build runs, as data -------------------------------------------------


def test_the_experts_are_read_from_the_record_and_for_unknown_architectures_from_the_config(tmp_path: Path) -> None:
    moe = make_model(tmp_path / "moe", "qwen3_moe", hidden_size=128, num_kv_heads=4, **SHAPES["qwen3_moe"])
    assert bundle_experts(bundle_config(moe)) == ExpertsShape(128, 128)
    assert bundle_experts(bundle_config(make_model(tmp_path / "mixtral", "mixtral"))) == ExpertsShape(64, 256)
    assert bundle_experts(bundle_config(make_model(tmp_path / "qwen3", "qwen3"))) is None
    every_layer_dense = {**bundle_config(moe), "mlp_only_layers": [0, 1, 2]}
    assert bundle_experts(every_layer_dense) is None
    unknown = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 96, "n_routed_experts": 8}
    assert bundle_experts({**unknown, "moe_intermediate_size": 64}) == ExpertsShape(96, 64)
    assert bundle_experts({**unknown, "n_routed_experts": 0}) is None


def test_the_experts_limits_follow_the_scheme_the_amx_verdict_and_the_shape() -> None:
    experts = ExpertsShape(128, 128)
    for scheme in (INT8_W8A8, INT4, FP8_BLOCK):
        assert cpu_limitation([scheme], WITH_AMX, HELLO) is None  # dense: these run on this CPU (with AMX)
        assert cpu_limitation([scheme], WITH_AMX, HELLO, experts=experts) is None
    int8 = cpu_limitation([INT8_W8A8], NO_AMX, HELLO, experts=experts)
    assert int8 is not None and int8.startswith("int8 W8A8 experts:") and "does not advertise AMX" in int8
    assert cpu_limitation([INT8_W8A8], NO_AMX, HELLO) is None  # the same bundle without experts runs here
    int4 = cpu_limitation([INT4], NO_AMX, HELLO, experts=experts)
    assert int4 is not None and "No WNA16 MoE backend" in int4
    fp8 = WeightScheme("float", 8, "channel", True)
    never = cpu_limitation([fp8], WITH_AMX, HELLO, experts=experts)
    assert never is not None and "128x128 blocks only" in never and "Unsupported FP8 MoE backend: NONE" in never
    narrow = cpu_limitation([], NO_AMX, HELLO, experts=ExpertsShape(48, 128))
    assert narrow is not None and "multiples of 32; this model's is 48" in narrow
    odd = cpu_limitation([INT8_W8A8], WITH_AMX, HELLO, experts=ExpertsShape(128, 80))
    assert odd is not None and "intermediate sizes in multiples of 32" in odd
    assert cpu_limitation([INT4], WITH_AMX, HELLO, experts=ExpertsShape(128, 80)) is None


def test_where_the_cpu_computes_the_experts_otherwise_the_version_says_so() -> None:
    assert experts_stand_ins([INT4], HELLO) == ("int4 experts with int8 activations (CPUExpertsInt4, W4A8)",)
    assert experts_stand_ins([FP8_BLOCK], HELLO) == ("block-FP8 experts with bf16 activations (CPUExpertsFp8, W8A16)",)
    assert experts_stand_ins([FP8_BLOCK], {**HELLO, "amx_fp8": True}) == ()
    assert experts_stand_ins([INT8_W8A8], HELLO) == ()
    assert all(limit.needs in ("never", "amx") for limit in CPU_EXPERTS_LIMITS)


# --- vLLM's figures against transformers' -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    """Each family's tiny model, made confident (`sharpened`) or as drawn; made once per module."""
    made: dict[tuple[str, bool], Path] = {}

    def get(family: str, sharpened: bool) -> Path:
        if (family, sharpened) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{'sharp' if sharpened else 'plain'}") / family
            made[family, sharpened] = make_model(out, family, hidden_size=128, num_kv_heads=4, **SHAPES[family])
            if sharpened:
                sharpen(made[family, sharpened])
        return made[family, sharpened]

    return get


@pytest.fixture(scope="module")
def bundles(
    models: Callable[[str, bool], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str, bool], Path]:
    made: dict[tuple[str, str, bool], Path] = {}

    def get(family: str, scheme: str, sharpened: bool = False) -> Path:
        key = (family, scheme, sharpened)
        if key not in made:
            made[key] = make_bundle(models(family, sharpened), tmp_path_factory.mktemp(f"{family}-{scheme}"), scheme)
        return made[key]

    return get


@pytest.fixture(scope="module")
def text(models: Callable[[str, bool], Path]) -> EvalText:
    body = Path(os.__file__).with_name("argparse.py").read_text()  # every family shares the tokenizer
    return tokenize_text(
        models("qwen3", False), body, window=96, max_tokens=384, prompts=4, prompt_tokens=12, greedy_tokens=12
    )


@pytest.fixture(scope="module")
def references(models: Callable[[str, bool], Path]) -> Iterator[Callable[[str, bool], CachedRuntime]]:
    opened: dict[tuple[str, bool], CachedRuntime] = {}

    def get(family: str, sharpened: bool) -> CachedRuntime:
        if (family, sharpened) not in opened:
            opened[family, sharpened] = CachedRuntime(TransformersRuntime(models(family, sharpened)))
        return opened[family, sharpened]

    yield get
    for rt in opened.values():
        rt.close()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_familys_bf16_bundle_in_vllm_agrees_with_the_reference(
    bundles: Callable[..., Path], references: Callable[[str, bool], CachedRuntime], text: EvalText, family: str
) -> None:
    report = evaluate_artifact(references(family, True), "vllm", bundles(family, "bf16", True), text, gate_for("bf16"))
    # The same weights in float32 arithmetic as the reference's, experts and windows included: only the kernels
    # differ. Measured: KL from 6e-12 (Phi-3) to 1.3e-9 (Qwen3-MoE), every top token and greedy token equal.
    assert report.status == "passed", (report.reason, report.failures)
    assert report.metrics is not None and report.metrics.kl < 1e-6 and report.metrics.top1 > 0.999
    assert (report.runtime_version or "").endswith("float32 activations, 2 threads")


def _agree(reference: CachedRuntime, bundle: Path, scheme: str, text: EvalText, why_not: str | None, case: str) -> None:
    """vLLM's eval of `bundle` is recorded not evaluated with `why_not`, or scores as transformers' does."""
    in_vllm = evaluate_artifact(reference, "vllm", bundle, text, gate_for(scheme))
    if why_not is not None:
        assert in_vllm.status == "not_evaluated" and in_vllm.runtime_needed == "vllm", case
        assert in_vllm.reason is not None and why_not in in_vllm.reason, case
        return
    in_transformers = evaluate_artifact(reference, "transformers", bundle, text, gate_for(scheme))
    assert in_vllm.metrics is not None and in_transformers.metrics is not None, (case, in_vllm.reason)
    vllm, transformers = in_vllm.metrics, in_transformers.metrics
    # Same weights, same activation quantization: only the kernels differ, and the activations' dtype where vLLM's
    # kernel takes no float32 (transformers computes in float32). Measured (KL vs the source, vLLM/transformers),
    # without AMX: Qwen3 FP8 1.0635e-4/1.0638e-4, Gemma 3 int4 5.449e-3/5.442e-3, Phi-3 int8 4.62e-6/4.65e-6, top-1
    # within 0.006. Where vLLM uses AMX its int8 and FP8 kernels take bfloat16 activations only, whose rounding
    # moves these tiny models' KL by more: Phi-3 int8 5.38e-6/4.65e-6, Mixtral int8 8.3e-6/1.09e-5, Qwen3-MoE block
    # FP8 experts 1.12e-4/1.72e-4 (top-1 0.911/0.868: routing follows the rounding). A misread scale or layout
    # moves it by orders of magnitude.
    bf16 = "bfloat16 activations" in (in_vllm.runtime_version or "")
    kl_within, top1_within = (0.5, 0.05) if bf16 else (0.1, 0.02)
    assert abs(vllm.kl - transformers.kl) < kl_within * transformers.kl, (case, vllm.kl, transformers.kl)
    assert abs(vllm.top1 - transformers.top1) <= top1_within, (case, vllm.top1, transformers.top1)


def _here(bundle: Path) -> str | None:
    """Why vLLM cannot run `bundle` on this machine, as the runtime decides it before loading."""
    config = bundle_config(bundle)
    hello = shared_worker(find("vllm").python, amx=vllm_capabilities().amx.used).hello  # type: ignore[union-attr]
    return cpu_limitation(
        bundle_schemes(config), vllm_capabilities(), hello, head_size(config), experts=bundle_experts(config)
    )


@pytest.mark.parametrize("family", list(DENSE_SCHEMES))
def test_a_quantized_bundle_of_each_dense_family_in_vllm_and_transformers_agree(
    bundles: Callable[..., Path], references: Callable[[str, bool], CachedRuntime], text: EvalText, family: str
) -> None:
    scheme = DENSE_SCHEMES[family]
    bundle = bundles(family, scheme)
    _agree(references(family, False), bundle, scheme, text, _here(bundle), f"{family} {scheme}")


@pytest.mark.parametrize(("family", "scheme"), MOE_CASES)
def test_a_mixtures_quantized_bundle_is_scored_or_not_evaluated_with_vllms_own_reason(
    bundles: Callable[..., Path],
    references: Callable[[str, bool], CachedRuntime],
    text: EvalText,
    family: str,
    scheme: str,
) -> None:
    bundle = bundles(family, scheme)
    why_not = _here(bundle)
    _agree(references(family, False), bundle, scheme, text, why_not, f"{family} {scheme}")
    if why_not is None:
        return
    # The reason is vLLM's: loaded past kiln's limits, vLLM refuses the bundle with the error the data quotes, and
    # the eval above was recorded instead of failing the build.
    worker = shared_worker(find("vllm").python, amx=vllm_capabilities().amx.used)  # type: ignore[union-attr]
    with pytest.raises(WorkerError) as refused:
        worker.request(
            {"op": "load", "model": str(bundle), "max_model_len": text.context_needed + 1,
             "kv_cache_bytes": 256 << 20, "full_vocab_limit": 1 << 20, "top_k": 8, "dtype": "float32"}
        )  # fmt: skip
    assert VLLM_REFUSALS[scheme] in str(refused.value), str(refused.value)


# --- a refused load does not poison the worker --------------------------------------------------------------


def test_after_a_load_vllm_refuses_the_same_worker_loads_a_mixture_and_a_dense_model(
    bundles: Callable[..., Path], references: Callable[[str, bool], CachedRuntime], text: EvalText
) -> None:
    """A dense model vLLM refuses after making its parallel groups (int8 weight-only: no CPU kernel) used to leave
    them behind, without the expert-parallel group a mixture needs ("expert parallel group is not
    initialized"); a refused mixture left its own. The worker tears them down and serves the next model."""
    worker = shared_worker(find("vllm").python, amx=vllm_capabilities().amx.used)  # type: ignore[union-attr]
    pid = worker.proc.pid
    request = {"op": "load", "max_model_len": text.context_needed + 1, "kv_cache_bytes": 256 << 20,
               "full_vocab_limit": 1 << 20, "top_k": 8, "dtype": "float32"}  # fmt: skip
    for refused, then in (("qwen3", "qwen3_moe"), ("qwen3_moe", "qwen3")):
        with pytest.raises(WorkerError):
            worker.request({**request, "model": str(bundles(refused, "int8-w8a16"))})
        rt = VllmRuntime(bundles(then, "bf16"), max_model_len=text.context_needed)
        try:
            window = text.windows[0]
            rows = rt.logits(window)
            expected = references(then, False).logits(window)
        finally:
            rt.close()
        assert shared_worker(find("vllm").python, amx=vllm_capabilities().amx.used).proc.pid == pid  # type: ignore[union-attr]
        np.testing.assert_allclose(rows, log_softmax(expected), atol=1e-4, err_msg=then)
