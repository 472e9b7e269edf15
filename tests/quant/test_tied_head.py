"""A tied head (`tie_word_embeddings`: Gemma 3, the small Qwen2 / Qwen3 models) through every scheme llm-compressor
quantizes or calibrates: the head is untied while calibrating (`quant.calibrated.untie_offloaded_head`) and the
bundle is tied as the source is (no `lm_head` tensor, `tie_word_embeddings` true), transformers loads it close to
the source, and its tensors are byte for byte those of the same model stored with an untied copy of its head.

The model is Qwen2-shaped (q/k/v biases, grouped KV heads), as the small Qwen releases that tie their head.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.eval.runtimes.transformers_runtime import TransformersRuntime
from kiln.quant.catalog import SCHEMES, get_method
from tests.model_factory import make_bundle, make_model

# Every scheme whose quantize stage runs llm-compressor (GPTQ, AWQ, FP4, the FP8 KV cache's scales).
BY_LLMCOMPRESSOR = [n for n, s in SCHEMES.items() if s.by_llmcompressor and not get_method(n).release_only]
# Relative error of the bundle's logits to the source's: 8-bit weights, then 4-bit (tests/targets/
# test_hf_bundle_families.py's bounds).
BOUND = {8: 0.16, 4: 0.6}


def _tensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def _raw(t: Any) -> tuple[str, tuple[int, ...], bytes]:
    import torch

    return str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tied model, and the same model with its head stored untied (a copy of the embedding)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("tied-qwen2")
    # Width 128: every Linear's input a whole int4 group; vocabulary 384 (the head's rows) a whole FP4 group.
    tied = make_model(
        root / "tied", "qwen2", tie_word_embeddings=True, hidden_size=128, intermediate_size=256, vocab_size=384
    )
    untied = Path(shutil.copytree(tied, root / "untied"))
    tensors = _tensors(untied / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(untied / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    return {"tied": tied, "untied": untied}


@pytest.fixture(scope="module")
def held_out() -> list[int]:
    return list(range(1, 384, 3))


def test_the_catalog_has_calibrated_schemes_to_check() -> None:
    assert {"w4a16-gptq", "w4a16-awq", "fp8-kv8", "nvfp4-w4a4"} <= set(BY_LLMCOMPRESSOR)


@pytest.mark.parametrize("scheme", BY_LLMCOMPRESSOR)
def test_a_tied_model_builds_tied_and_as_its_untied_copy(
    scheme: str, models: dict[str, Path], held_out: list[int], tmp_path: Path
) -> None:
    tied = make_bundle(models["tied"], tmp_path / "tied", scheme)
    untied = make_bundle(models["untied"], tmp_path / "untied", scheme)
    config = json.loads((tied / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head" in config["quantization_config"]["ignore"]  # the head stays the embedding, in bf16
    stored, reference = _tensors(tied / "model.safetensors"), _tensors(untied / "model.safetensors")
    assert not [n for n in stored if n.startswith("lm_head")]
    assert set(stored) == set(reference) - {"lm_head.weight"}
    for name, t in stored.items():  # calibration saw the same function: the same choices, bit for bit
        assert _raw(t) == _raw(reference[name]), name

    logits = TransformersRuntime(tied, "float32").logits(held_out)
    source = TransformersRuntime(models["tied"], "float32").logits(held_out)
    rel = float(np.linalg.norm(logits - source) / np.linalg.norm(source))
    w = SCHEMES[scheme].weights
    assert w is not None and np.isfinite(logits).all() and rel < BOUND[w.num_bits], (scheme, rel)


@pytest.mark.slow
def test_kiln_build_builds_and_passes_every_such_scheme_for_a_tied_model(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """What a user runs: `kiln build` of the tied model's hf-bundles of every such scheme, each evaluated in
    transformers against the source's reference and passing its scheme's default gate, and each tied."""
    from tests.test_end_to_end import ROOT, kiln

    examples = ROOT / "examples" / "tiny-llama"
    (tmp_path / "heldout.txt").write_text((examples / "heldout.txt").read_text()[:12000])
    (tmp_path / "calibration.txt").write_text((examples / "train.py").read_text())
    shutil.copytree(models["tied"], tmp_path / "model")  # a recipe's source is beside it
    recipe = {
        "model": "tied-qwen2",
        "version": "1.0.0",
        "source": "model",
        "eval": {"text": "heldout.txt", "max_tokens": 256, "window": 64, "greedy_prompts": 1, "greedy_tokens": 4},
        "calibration": {"text": "calibration.txt", "samples": 4, "seq_len": 64},
        "targets": [{"target": "hf-bundle", "quants": BY_LLMCOMPRESSOR}],
    }
    (tmp_path / "kiln.yaml").write_text(json.dumps(recipe))
    env = {
        **os.environ,
        "KILN_WORK_DIR": str(tmp_path / "work"),
        "KILN_RUNTIMES": str(tmp_path / "no-runtimes"),  # vLLM left out: transformers evaluates
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    }
    built = json.loads(kiln("build", str(tmp_path / "kiln.yaml"), "--json", env=env).stdout)
    assert built["failed_gates"] == [] and built["deferred"] == []
    artifacts = {a["artifact"]: a for a in built["artifacts"]}
    assert sorted(artifacts) == sorted(f"hf-bundle-{q}" for q in BY_LLMCOMPRESSOR)
    for name, a in artifacts.items():
        assert a["eval"] == "passed" and a["evals"][0]["runtime"] == "transformers", (name, a["failures"])
        bundle = Path(a["path"])
        assert json.loads((bundle / "config.json").read_text())["tie_word_embeddings"] is True, name
        assert not [n for n in _tensors(bundle / "model.safetensors") if n.startswith("lm_head")], name
