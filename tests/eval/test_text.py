"""Held-out text becomes the same token windows and prompts for every runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.errors import InvalidInput
from kiln.eval.text import EvalText, load_text, tokenize_text


def hf_ids(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    ids: list[int] = AutoTokenizer.from_pretrained(str(model_dir))(text, add_special_tokens=False)["input_ids"]
    return ids


def test_windows_are_bos_plus_consecutive_text(llama_dir: Path, heldout_text: str, eval_text: EvalText) -> None:
    bos = json.loads((llama_dir / "config.json").read_text())["bos_token_id"]
    assert eval_text.bos_token_id == bos
    assert eval_text.vocab_size == 512
    assert all(w[0] == bos and 2 <= len(w) <= 128 for w in eval_text.windows)
    assert sum(len(w) for w in eval_text.windows) <= 1024
    assert eval_text.tokens == sum(len(w) - 1 for w in eval_text.windows)
    body = [t for w in eval_text.windows for t in w[1:]]
    assert body == hf_ids(llama_dir, heldout_text)[: len(body)]


def test_prompts_are_window_prefixes_spread_over_the_text(eval_text: EvalText) -> None:
    assert len(eval_text.prompts) == 4 and eval_text.greedy_tokens == 16
    starts = [next(i for i, w in enumerate(eval_text.windows) if w[:16] == p) for p in eval_text.prompts]
    assert starts == sorted(set(starts)) and starts[0] == 0 and starts[-1] == len(eval_text.windows) - 1
    assert eval_text.context_needed == 128


def test_without_bos(llama_dir: Path, heldout_text: str) -> None:
    text = tokenize_text(llama_dir, heldout_text, window=64, max_tokens=256, add_bos=False)
    assert text.bos_token_id is None
    assert [len(w) for w in text.windows] == [64] * 4
    assert [t for w in text.windows for t in w] == hf_ids(llama_dir, heldout_text)[:256]


def test_digest_names_what_is_compared(llama_dir: Path, heldout_text: str, eval_text: EvalText) -> None:
    same = tokenize_text(
        llama_dir, heldout_text, window=128, max_tokens=1024, prompts=4, prompt_tokens=16, greedy_tokens=16
    )
    assert same == eval_text and same.digest == eval_text.digest
    other = tokenize_text(llama_dir, heldout_text, window=128, max_tokens=1024, prompts=4, prompt_tokens=16)
    assert other.digest != eval_text.digest  # 32 greedy tokens instead of 16


def test_short_text_and_bad_arguments(llama_dir: Path, tmp_path: Path) -> None:
    short = tokenize_text(llama_dir, "def f(x): return x", prompts=4, prompt_tokens=4)
    assert len(short.windows) == 1 and len(short.prompts) == 1  # one window: one prompt
    no_prompts = tokenize_text(llama_dir, "def f(x): return x", prompt_tokens=100)
    assert no_prompts.prompts == () and no_prompts.greedy_tokens == 0
    with pytest.raises(InvalidInput, match="at least one window"):
        tokenize_text(llama_dir, "")
    with pytest.raises(InvalidInput, match="window"):
        tokenize_text(llama_dir, "abc", window=1)
    with pytest.raises(InvalidInput, match="does not exist"):
        load_text(llama_dir, tmp_path / "missing.txt")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(InvalidInput, match="not UTF-8"):
        load_text(llama_dir, tmp_path / "latin1.txt")
    (tmp_path / "ok.txt").write_text("def f(x): return x", encoding="utf-8")
    assert load_text(llama_dir, tmp_path / "ok.txt", prompt_tokens=4) == short


def test_stored_ids_round_trip_and_are_checked(eval_text: EvalText) -> None:
    """The reference stage stores the ids once; every eval reads them back, refused unless they are the
    ids the reference's record names (by digest) and well formed."""
    stored = eval_text.to_json()
    assert EvalText.from_json(stored, digest=eval_text.digest) == eval_text
    with pytest.raises(InvalidInput) as e:
        EvalText.from_json(stored, digest="0" * 64)
    assert e.value.code == "EVAL_TEXT_INVALID"
    data = json.loads(stored)
    data["windows"][0][1] += 1  # one id changed: the digest no longer matches
    tampered = json.dumps(data)
    for bad in (
        tampered,
        json.dumps({**data, "windows": [[1, -2]]}),
        json.dumps({**data, "windows": [[1, 2.5]]}),
        json.dumps({**data, "windows": "1 2 3"}),
        json.dumps({k: v for k, v in data.items() if k != "prompts"}),
    ):
        with pytest.raises(InvalidInput) as e:
            EvalText.from_json(bad, digest=eval_text.digest)
        assert e.value.code == "EVAL_TEXT_INVALID"
    with pytest.raises(InvalidInput):
        EvalText.from_json(b"{not json", digest=eval_text.digest)
