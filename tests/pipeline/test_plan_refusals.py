"""What a stage would refuse of the model or of its files, `kiln plan` refuses first, with the stage's own error:
an orbax mesh whose model axis does not split the attention heads (the export's sharding plan), a tokenizer to
which transformers adds special tokens past the vocabulary (GGUF's prepare stage), and fp8-block on a k_proj of
64 rows, which vLLM runs in one GEMM with q_proj and v_proj (the quantize stage's shape check). `kiln build` plans
first, so it refuses the same before ingest runs: no stage writes anything."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.core.errors import KilnError
from kiln.formats.hf_model import open_source
from kiln.quant.catalog import get_scheme
from kiln.quant.rtn import check_shapes
from kiln.targets.base import ExportRequest, get_target
from tests.model_factory import make_model

HELDOUT = "def add(a, b):\n    return a + b\n\n" * 40  # no special token in it: the reference would tokenize it


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=600)


def six_heads(out: Path) -> Path:
    """Six attention heads of 16 (two KV heads): a `model` axis of 4 splits neither q_proj nor o_proj by heads."""
    return make_model(out, "llama", hidden_size=96, num_heads=6, num_kv_heads=2)


def qwen2_without_specials(out: Path) -> Path:
    """A Qwen2 tokenizer whose tokenizer.json lacks '<|endoftext|>' (its one special token renamed) and whose
    tokenizer_config.json names no special token: transformers' Qwen2Tokenizer adds its default unk/eos/pad
    '<|endoftext|>' at id 512, past the 512 rows of the embedding."""
    model = make_model(out, "qwen2", vocab_size=512, num_heads=4, num_kv_heads=2)
    tok = json.loads((model / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        added["content"] = "<|sep|>"
    tok["model"]["vocab"]["<|sep|>"] = tok["model"]["vocab"].pop("<|endoftext|>")
    (model / "tokenizer.json").write_text(json.dumps(tok))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    return model


def one_kv_head(out: Path) -> Path:
    """A Qwen2 of 6 heads of 64 with one KV head: k_proj and v_proj have 64 rows, half a 128-row FP8 block."""
    return make_model(out, "qwen2", hidden_size=384, num_heads=6, num_kv_heads=1)


def quantize_check(model: Path, out: Path, target: dict[str, Any]) -> None:
    """What the quantize stage runs before it reads a tensor."""
    source = open_source(model)
    check_shapes(
        get_scheme(target["quants"][0]), {n: t.shape for n, t in source.tensors.items()}, source.shape.merged_gemms()
    )


def orbax_export(model: Path, out: Path, target: dict[str, Any]) -> None:
    """What the orbax export stage runs."""
    out.mkdir()
    get_target("orbax").export(open_source(model), ExportRequest(quant="bf16", out_dir=out, params=target["params"]))


def gguf_prepare(model: Path, out: Path, target: dict[str, Any]) -> None:
    """What the `prepare/gguf` stage runs."""
    prepare = get_target("gguf").prepare
    assert prepare is not None
    prepare(open_source(model))


Case = tuple[Callable[[Path], Path], dict[str, Any], Callable[[Path, Path, dict[str, Any]], None], str, str]
# model, the recipe's target, the stage that refuses it, the code, what the message says
CASES: dict[str, Case] = {
    "orbax-mesh": (
        six_heads,
        {"target": "orbax", "quants": ["bf16"], "params": {"mesh": {"data": 2, "model": 4}}},
        orbax_export,
        "ORBAX_SHARDING_NOT_DIVISIBLE",
        "holds 6 attention heads of 16, which do not split into whole heads over mesh axis 'model' of size 4",
    ),
    "gguf-special-tokens": (
        qwen2_without_specials,
        {"target": "gguf", "quants": ["f16"]},
        gguf_prepare,
        "GGUF_VOCAB_MISMATCH",
        "transformers' Qwen2Tokenizer added it (as the default eos_token / unk_token / pad_token)",
    ),
    "fp8-block-merged-rows": (
        one_kv_head,
        {"target": "hf-bundle", "quants": ["fp8-block"]},
        quantize_check,
        "QUANT_SHAPE",
        "every layer's self_attn.k_proj has 64 output rows, not a whole number of 128x128 blocks' 128",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_refuses_what_the_stage_would_and_build_refuses_it_before_ingest(case: str, tmp_path: Path) -> None:
    make, target, stage, code, says = CASES[case]
    model: Path = make(tmp_path / "model")
    with pytest.raises(KilnError) as refused:  # the stage's own refusal, as a build met it after ingest
        stage(model, tmp_path / "out", target)
    assert refused.value.code == code and says in refused.value.message, refused.value.message

    (tmp_path / "heldout.txt").write_text(HELDOUT)
    recipe = {"model": "m", "version": "1", "source": "model", "eval": {"text": "heldout.txt"}, "targets": [target]}
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    for command in ("plan", "build"):
        work = tmp_path / f"work-{command}"
        out = kiln(command, str(tmp_path / "kiln.yaml"), "--json", "--work-dir", str(work))
        assert out.returncode == 2, out.stderr
        error = json.loads(out.stdout)["error"]
        assert (error["code"], error["message"]) == (refused.value.code, refused.value.message)
        assert "stage" not in error["details"]  # refused by the plan, not by a stage that ran
        # Nothing ran: no stage wrote its output (a build keeps only the hash cache of the source it read).
        written = [p.name for p in work.iterdir() if p.is_dir()] if work.exists() else []
        assert written == [], written


def test_a_source_check_passed_is_remembered_and_a_changed_tokenizer_checked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan (every warm build, every publish) loads the tokenizer for the GGUF check only the first time the
    source's files pass it; a source whose tokenizer changed is checked, and refused, again."""
    from kiln.pipeline.build import SOURCE_CHECKS_DIR, plan
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store
    from kiln.targets.gguf import tokenizer

    model = make_model(tmp_path / "model", "qwen2", vocab_size=512, num_heads=4, num_kv_heads=2)
    (tmp_path / "heldout.txt").write_text(HELDOUT)
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt"},
        "targets": [{"target": "gguf", "quants": ["f16"]}],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    checks: list[Path] = []
    check = tokenizer.check_special_tokens
    monkeypatch.setattr(tokenizer, "check_special_tokens", lambda root, n: (checks.append(root), check(root, n))[1])
    store = open_store(None, tmp_path / "work")

    for _ in range(2):
        plan(load_recipe(tmp_path / "kiln.yaml"), store)
    assert checks == [model]
    assert len(list((tmp_path / "work" / SOURCE_CHECKS_DIR).iterdir())) == 1

    qwen2_without_specials(tmp_path / "bad")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tmp_path / "bad" / name).read_bytes())
    with pytest.raises(KilnError) as refused:
        plan(load_recipe(tmp_path / "kiln.yaml"), store)
    assert refused.value.code == "GGUF_VOCAB_MISMATCH" and checks == [model, model]
