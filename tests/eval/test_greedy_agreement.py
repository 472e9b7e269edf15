"""Greedy agreement decoded by the candidate, or teacher-forced on the reference's continuation (eval.run.measure).

Up to the first token where a candidate leaves the reference's continuation both ways see the same text, so
the common prefix (`greedy_match`) is the same; after it, a decoding candidate continues its own text and a
teacher-forced one the reference's, so `greedy_match_total` counts different things (docs/evaluation.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.eval.run import measure
from kiln.eval.runtimes import CachedRuntime, TransformersRuntime
from kiln.eval.runtimes.layer_stream import LayerStream
from kiln.eval.text import EvalText


@pytest.fixture(scope="module")
def perturbed(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The eval model with noise on its MLPs: close enough to agree on some greedy tokens, not on all."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed") / "llama"
    shutil.copytree(llama_dir, out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if ".mlp." in name:
            noise = torch.randn(t.shape, generator=generator) * t.float().std() * 0.5
            weights[name] = (t.float() + noise).to(torch.bfloat16).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_same_weights_agree_on_every_token_both_ways(
    llama_dir: Path, reference: CachedRuntime, eval_text: EvalText
) -> None:
    for candidate in (TransformersRuntime(llama_dir), LayerStream(llama_dir)):
        try:
            for forced in (True, False):
                metrics = measure(reference, candidate, eval_text, teacher_forced=forced)
                assert metrics.greedy_match == metrics.greedy_match_total == 1.0, (type(candidate), forced)
                assert metrics.greedy_tokens == len(eval_text.prompts) * eval_text.greedy_tokens
        finally:
            candidate.close()


def test_teacher_forcing_keeps_the_common_prefix_and_counts_agreement_on_the_references_text(
    perturbed: Path, reference: CachedRuntime, eval_text: EvalText
) -> None:
    whole, stream = TransformersRuntime(perturbed), LayerStream(perturbed)
    try:
        decoded = measure(reference, whole, eval_text, teacher_forced=False)
        forced = measure(reference, whole, eval_text, teacher_forced=True)
        streamed = measure(reference, stream, eval_text)  # transformers: teacher-forced by its runtime facts
    finally:
        whole.close()
        stream.close()
    assert decoded.greedy_match is not None and forced.greedy_match_total is not None
    assert 0.0 < decoded.greedy_match < 1.0  # they part somewhere
    assert forced.greedy_match == decoded.greedy_match
    assert forced.greedy_match <= forced.greedy_match_total < 1.0
    # Held whole or streamed by layer, the same teacher-forced agreement and the same scores.
    assert (streamed.greedy_match, streamed.greedy_match_total) == (forced.greedy_match, forced.greedy_match_total)
    assert streamed.top1 == forced.top1
    assert streamed.kl == pytest.approx(forced.kl, rel=1e-4)
