"""Which architectures vLLM serves: every family's record admits it (vLLM 0.32's CPU build loads and scores each
one's tiny model, tests/placement/test_vllm_kv.py loads them all; DeepSeek-V3 and gpt-oss in
tests/eval/test_vllm_frontier.py); a record that refuses it makes the vLLM eval record "not evaluated" with the
record's reason, and so does a layout vLLM's model of the family refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kiln.eval.gates import gate_for
from kiln.eval.run import evaluate_artifact
from kiln.eval.runtimes.vllm_support import architecture_limitation
from kiln.eval.text import EvalText, tokenize_text
from kiln.formats.architectures import ARCHITECTURES, FAMILIES
from kiln.formats.architectures.record import refused
from tests.model_factory import FAMILIES as FACTORY_FAMILIES
from tests.model_factory import make_model


@pytest.mark.parametrize("family", list(FACTORY_FAMILIES))
def test_vllm_serves_every_family_kiln_builds(tmp_path: Path, family: str) -> None:
    config = json.loads((make_model(tmp_path / family, family) / "config.json").read_text())
    record = FAMILIES[family]
    assert record.target("vllm").supported
    assert architecture_limitation(config) is None


def test_a_record_that_refuses_vllm_gives_its_reason(tmp_path: Path) -> None:
    config = json.loads((make_model(tmp_path / "gemma3", "gemma3") / "config.json").read_text())
    record = FAMILIES["gemma3"]
    reason = "vLLM has no model of this family's attention yet"
    records = {
        **ARCHITECTURES,
        record.hf_class: dataclasses.replace(record, targets={**record.targets, "vllm": refused(reason)}),
    }
    assert architecture_limitation(config, records) == f"Gemma3ForCausalLM (gemma3): {reason}"
    assert architecture_limitation({"architectures": ["NotAModel"]}, records) is None  # vLLM's own load decides


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_that_slides_some_layers_is_not_evaluated_in_vllm(tmp_path: Path, family: str) -> None:
    # Qwen's window covers the layers from max_window_layers on: here the last two of four. vLLM's Qwen2 model
    # (which Qwen3's builds on) takes every layer sliding or none.
    model = make_model(
        tmp_path / family, family, num_layers=4, use_sliding_window=True, sliding_window=32, max_window_layers=2
    )
    config = json.loads((model / "config.json").read_text())
    why = architecture_limitation(config)
    assert why is not None and "slides every layer or none" in why
    assert config["layer_types"] == ["full_attention"] * 2 + ["sliding_attention"] * 2  # as transformers wrote it
    derived = {k: v for k, v in config.items() if k != "layer_types"}  # the layout from max_window_layers
    assert architecture_limitation(derived) is not None
    assert architecture_limitation({**derived, "max_window_layers": 4}) is None  # no layer slides
    assert architecture_limitation({**derived, "use_sliding_window": False}) is None

    text: EvalText = tokenize_text(model, "def f(x):\n    return x + 1\n" * 40, window=32, max_tokens=64)
    report = evaluate_artifact(None, "vllm", model, text, gate_for("bf16"))  # type: ignore[arg-type]
    assert report.status == "not_evaluated" and report.runtime_needed == "vllm"
    assert report.reason is not None and "slides every layer or none" in report.reason
