"""The families of 2025-26, end to end: each one's tiny model (made by transformers' own class) builds the probe
recipe of every target (GGUF F16 and Q8_0, hf-bundle bf16, FP8 and W4A16 GPTQ, orbax bf16), and every artifact
is evaluated in each runtime that serves it here and passes its gate; a target a family's record refuses is
refused at plan time with the record's reason instead.

vLLM is left out (its environment is pointed at an empty directory, so its evals are recorded not evaluated):
tests/eval/test_vllm_runtime.py runs it. The reference is computed on 1,024 held-out tokens in 128-token windows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from kiln.formats.architectures import FAMILIES
from tests.model_factory import NEW_FAMILIES, make_model
from tests.test_end_to_end import ROOT, kiln

pytestmark = pytest.mark.slow

# A random model predicts almost uniformly (perplexity about its vocabulary), so its top two tokens are close and
# any rounding swaps them: the default top-1 gates, set for trained models, would judge the noise. The quantized
# artifacts keep every default KL and perplexity gate and need half the positions' top token; a broken
# conversion (a missing permutation, misplaced experts) scores top-1 near 1/vocab and KL near 1, and fails.
RANDOM_MODEL_GATES = {q: {"min_top1": 0.5} for q in ("q8_0", "fp8", "w4a16-gptq")}
# llama.cpp looks tokens up by the model's name (a name with "phi3" in it needs '<s>', '<unk>', '</s>'): the GGUF
# files are named apart from the recipe's model.
PARAMS: dict[str, dict[str, object]] = {"gguf": {"params": {"name": "probe"}}}
# Every Linear's input a multiple of GPTQ's 128-wide groups (the factory's Qwen3-MoE experts are 64 wide), and
# Gemma 3's attention scaled by its head_dim (32 here), as Gemma 3 1B-12B are and llama.cpp's gemma3 computes.
WIDTHS: dict[str, dict[str, int]] = {
    "qwen3_moe": {"moe_intermediate_size": 128},
    "gemma3": {"query_pre_attn_scalar": 32},
}
PROBE = {"gguf": ["f16", "q8_0"], "hf-bundle": ["bf16", "fp8", "w4a16-gptq"], "orbax": ["bf16"]}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_probe_recipe_builds_and_passes_for_each_family(family: str, tmp_path: Path) -> None:
    # hidden 128 and intermediate 256: every Linear's rows fill GGUF's and GPTQ's 32- and 128-wide groups.
    source = make_model(
        tmp_path / "model", family, hidden_size=128, intermediate_size=256, vocab_size=512, **WIDTHS.get(family, {})
    )
    held_out = (ROOT / "examples" / "tiny-llama" / "heldout.txt").read_text()
    (tmp_path / "heldout.txt").write_text(held_out[:20000])
    (tmp_path / "calibration.txt").write_text((ROOT / "examples" / "tiny-llama" / "train.py").read_text())
    arch = FAMILIES[family]
    served = {t: q for t, q in PROBE.items() if t == "hf-bundle" or arch.target(t).supported}
    recipe = {
        "model": f"probe-{family.replace('_', '-')}",
        "version": "1.0.0",
        "source": str(source),
        "eval": {
            "text": "heldout.txt",
            "max_tokens": 1024,
            "window": 128,
            "greedy_prompts": 2,
            "greedy_tokens": 8,
            "gates": RANDOM_MODEL_GATES,
        },
        "calibration": {"text": "calibration.txt", "samples": 8, "seq_len": 64},
        "targets": [{"target": t, "quants": q, **PARAMS.get(t, {})} for t, q in served.items()],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    env = {
        **os.environ,
        "KILN_WORK_DIR": str(tmp_path / "work"),
        "KILN_RUNTIMES": str(tmp_path / "no-runtimes"),
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    }
    built = json.loads(kiln("build", str(tmp_path / "kiln.yaml"), "--json", env=env).stdout)

    assert built["failed_gates"] == [] and built["deferred"] == []
    artifacts = {a["artifact"]: a for a in built["artifacts"]}
    assert sorted(artifacts) == sorted(f"{t}-{q}" for t, quants in served.items() for q in quants)
    for name, artifact in artifacts.items():
        first, *others = artifact["evals"]
        assert artifact["eval"] == "passed" and first["status"] == "passed", (name, first)
        runtime = {"gguf": "llama.cpp", "orbax": "jax"}.get(name.split("-")[0], "transformers")
        assert first["runtime"] == runtime
        assert all(e["status"] == "not_evaluated" for e in others), (name, others)
