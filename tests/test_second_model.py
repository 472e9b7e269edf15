"""The second example model (examples/tiny-llama-3k): its 4-bit artifacts pass their gates, and it is the model
its card describes.

A cut-down recipe of its comparison set (int4 round-to-nearest, NVFP4 weight-only, GGUF Q4_0, and the FP8 KV
cache) is built against the committed model over the whole held-out text, so the reference's perplexity can be
held against the one `train.py` measured and wrote in `model_card.json`. The two score the same 25,971 tokens
but window them differently: `train.py` cuts 256-token windows and predicts 255 of each, kiln puts BOS before
255 tokens of text and predicts all of them, the first of each window from BOS alone, so kiln's figure is the
higher: +1.8 % on examples/tiny-llama (65.73 against 64.54), +1.6 % here (30.96 against 30.47).

vLLM is left out (its environment is pointed at an empty directory, so its evals are recorded not evaluated): at
this budget its int4 eval alone took 49 s on a busy 2-core machine, and tests/eval/test_vllm_runtime.py and the
end-to-end build run it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.test_end_to_end import ROOT, kiln

EXAMPLE = ROOT / "examples" / "tiny-llama-3k"
CARD = json.loads((EXAMPLE / "model_card.json").read_text())
# kiln's reference perplexity over the card's (measured on both examples; see the module's docstring).
PPL_ABOVE_CARD = (1.0, 1.03)

pytestmark = pytest.mark.slow


def test_the_second_models_4bit_artifacts_pass_their_gates_and_it_matches_its_card(tmp_path: Path) -> None:
    # Calibration (the KV cache's scales) on text the eval does not score and the model never trained on:
    # the first example's training script, Python outside the standard library.
    (tmp_path / "calibration.txt").write_text((ROOT / "examples" / "tiny-llama" / "train.py").read_text())
    recipe = {
        "model": "tiny-llama-3k-check",
        "version": "1.0.0",
        "source": str(EXAMPLE / "model"),
        "eval": {
            "text": str(EXAMPLE / "heldout.txt"),
            "max_tokens": 32768,  # the whole held-out text, as the card measured it
            "greedy_prompts": 1,
            "greedy_tokens": 8,
        },
        "calibration": {"text": "calibration.txt", "samples": 8},
        "targets": [
            {"target": "gguf", "quants": ["q4_0"]},
            {"target": "hf-bundle", "quants": ["int4-rtn", "nvfp4-w4a16", "fp8-kv8"]},
        ],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    env = {
        **os.environ,
        "KILN_WORK_DIR": str(tmp_path / "work"),
        "KILN_RUNTIMES": str(tmp_path / "no-runtimes"),
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    }

    built = json.loads(
        kiln("build", str(tmp_path / "kiln.yaml"), "--allow-outside", str(EXAMPLE), "--json", env=env).stdout
    )

    assert built["failed_gates"] == [] and built["deferred"] == []
    artifacts = {a["artifact"]: a for a in built["artifacts"]}
    assert sorted(artifacts) == ["gguf-q4_0", "hf-bundle-fp8-kv8", "hf-bundle-int4-rtn", "hf-bundle-nvfp4-w4a16"]
    for name, artifact in artifacts.items():
        first, *others = artifact["evals"]
        assert artifact["eval"] == "passed" and first["status"] == "passed" and first["failures"] == [], artifact
        assert first["runtime"] == ("llama.cpp" if name.startswith("gguf") else "transformers")
        assert [(e["runtime"], e["status"]) for e in others] == [("vllm", "not_evaluated")] * len(others), name

    references = {a["metrics"]["ppl_ref"] for a in artifacts.values()}
    assert len(references) == 1  # one reference, shared by every eval
    (reference,) = references
    assert all(a["metrics"]["tokens"] == CARD["eval"]["tokens"] for a in artifacts.values())
    low, high = PPL_ABOVE_CARD
    assert low * CARD["eval"]["perplexity"] <= reference <= high * CARD["eval"]["perplexity"], (
        reference,
        CARD["eval"]["perplexity"],
    )
