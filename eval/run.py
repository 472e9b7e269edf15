"""Run an eval: feed the same windows to the reference and a candidate, score, and judge the gate.

    text = load_text(source_dir, heldout_path)
    reference = stored_reference(reference_stage_output)   # the reference stage's rows (a build)
    reference = CachedRuntime(TransformersRuntime(source_dir))  # or a runtime, kept whole (tests, benchmarks)
    for artifact in artifacts:
        report = evaluate_artifact(reference, "llama.cpp", artifact.path, text, gate_for(artifact.quant))

The reference is either the rows the reference stage stored (`eval.reference_rows.ReferenceStore`) or
a runtime whose full logits are taken as rows that keep every token (exact KL). Windows are processed
one at a time (reference rows, candidate logits, accumulate), so memory is one window's candidate
logits plus the metrics' bounded work block. Greedy agreement is decoded by the candidate, or teacher-forced
on the reference's continuation in the same call as the windows (`measure`, docs/evaluation.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.errors import Deferred
from kiln.eval.gates import EvalMetrics, Gate
from kiln.eval.metrics import MetricAccumulator
from kiln.eval.reference_rows import ReferenceRows, ReferenceStore, reference_rows
from kiln.eval.report import EvalReport, judged
from kiln.eval.runtimes import RUNTIME_FACTS, Runtime, open_runtime
from kiln.eval.text import EvalText

Reference = Runtime | ReferenceStore


def reference_window(reference: Reference, window: Sequence[int], vocab_size: int | None) -> ReferenceRows:
    """The reference's rows for `window`: stored, or from a runtime's full logits with every token kept.
    Row t predicts token t + 1; the last position predicts past the window and is not scored."""
    if isinstance(reference, ReferenceStore):
        return reference.rows(window)
    logits = reference.logits(window)
    return reference_rows(logits[:-1], window[1:], vocab_size=vocab_size, tail_mass=0.0, max_entries=logits.shape[1])


def measure(
    reference: Reference, candidate: Runtime, text: EvalText, *, teacher_forced: bool | None = None
) -> EvalMetrics:
    """The metrics of `candidate` against `reference` on `text` (see `eval.metrics`).

    Greedy agreement compares each prompt's reference continuation with the candidate's: decoded by the
    candidate itself, or `teacher_forced` (by default as the candidate's runtime facts say,
    `RuntimeFacts.greedy`): the candidate's argmax at each position of one forward over the prompt and the
    reference's continuation, its logits taken in the same call as the windows'. The common prefix is the
    same either way (up to the first divergence both see the same tokens); see docs/evaluation.md."""
    acc = MetricAccumulator(text.vocab_size)
    prompts = text.prompts if text.greedy_tokens else ()
    expected = reference.greedy(prompts, text.greedy_tokens) if prompts else []
    if teacher_forced is None:
        facts = RUNTIME_FACTS.get(candidate.name)
        teacher_forced = facts is not None and facts.greedy == "teacher-forced"
    forced = [(*p, *want[:-1]) for p, want in zip(prompts, expected, strict=True)] if teacher_forced else []
    sequences = [*text.windows, *forced]
    # A runtime that streams its layers reads them once for every sequence (`logits_many`), not once per sequence.
    many = getattr(candidate, "logits_many", None)
    outputs = iter(many(sequences) if many is not None else (candidate.logits(s) for s in sequences))
    for window in text.windows:
        ref = reference_window(reference, window, text.vocab_size)
        acc.add_rows(ref, next(outputs)[:-1], window[1:])
    if teacher_forced:
        for prompt, want in zip(prompts, expected, strict=True):
            # Position len(prompt) - 1 + i predicts continuation token i, after the reference's first i.
            scored = np.asarray(next(outputs))[len(prompt) - 1 :, : text.vocab_size]
            acc.add_greedy(want, np.argmax(scored, axis=-1).tolist())
    elif expected:
        for want, got in zip(expected, candidate.greedy(prompts, text.greedy_tokens), strict=True):
            acc.add_greedy(want, got)
    return acc.result()


def evaluate(reference: Reference, candidate: Runtime, text: EvalText, gate: Gate) -> EvalReport:
    """Compare `candidate` with `reference` on `text` and judge the result against `gate`."""
    metrics = measure(reference, candidate, text)
    return judged(
        metrics,
        gate,
        runtime=candidate.name,
        runtime_version=candidate.version,
        reference=reference.name,
        reference_version=reference.version,
        text_digest=text.digest,
    )


def evaluate_artifact(
    reference: Reference,
    runtime: str,
    artifact: str | Path,
    text: EvalText,
    gate: Gate,
    **runtime_options: Any,
) -> EvalReport:
    """Open `artifact` in `runtime` and evaluate it; *not evaluated here* when that runtime is absent.

    llama.cpp and vLLM are opened with a context that fits the text unless one is given.
    """
    if runtime == "llama.cpp":
        runtime_options.setdefault("n_ctx", max(text.context_needed, 64))
        runtime_options.setdefault("vocab_size", text.vocab_size)
    if runtime == "vllm":
        runtime_options.setdefault("max_model_len", max(text.context_needed, 64))
    try:
        candidate = open_runtime(runtime, artifact, **runtime_options)
    except Deferred as e:
        return EvalReport.not_evaluated(str(e.details.get("runtime_needed", runtime)), e.message, gate=gate)
    try:
        return evaluate(reference, candidate, text, gate)
    finally:
        candidate.close()
