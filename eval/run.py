"""Run an eval: feed the same windows to the reference and a candidate, score, and judge the gate.

    text = load_text(source_dir, heldout_path)
    reference = stored_reference(reference_stage_output)   # the reference stage's rows (a build)
    reference = CachedRuntime(TransformersRuntime(source_dir))  # or a runtime, kept whole (tests, benchmarks)
    for artifact in artifacts:
        report = evaluate_artifact(reference, "llama.cpp", artifact.path, text, gate_for(artifact.quant))

The reference is either the rows the reference stage stored (`eval.reference_rows.ReferenceStore`) or
a runtime whose full logits are taken as rows that keep every token (exact KL). Windows are processed
one at a time (reference rows, candidate logits, accumulate), so memory is one window's candidate
logits plus the metrics' bounded work block.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.errors import Deferred
from eval.gates import EvalMetrics, Gate
from eval.metrics import MetricAccumulator
from eval.reference_rows import ReferenceRows, ReferenceStore, reference_rows
from eval.report import EvalReport, judged
from eval.runtimes import Runtime, open_runtime
from eval.text import EvalText

Reference = Runtime | ReferenceStore


def reference_window(reference: Reference, window: Sequence[int], vocab_size: int | None) -> ReferenceRows:
    """The reference's rows for `window`: stored, or from a runtime's full logits with every token kept.
    Row t predicts token t + 1; the last position predicts past the window and is not scored."""
    if isinstance(reference, ReferenceStore):
        return reference.rows(window)
    logits = reference.logits(window)
    return reference_rows(logits[:-1], window[1:], vocab_size=vocab_size, tail_mass=0.0, max_entries=logits.shape[1])


def measure(reference: Reference, candidate: Runtime, text: EvalText) -> EvalMetrics:
    """The metrics of `candidate` against `reference` on `text` (see `eval.metrics`)."""
    acc = MetricAccumulator(text.vocab_size)
    # A runtime that streams its layers reads them once for every window (`logits_many`), not once per window.
    many = getattr(candidate, "logits_many", None)
    candidates = many(text.windows) if many is not None else (candidate.logits(w) for w in text.windows)
    for window, cand in zip(text.windows, candidates, strict=True):
        ref = reference_window(reference, window, text.vocab_size)
        acc.add_rows(ref, cand[:-1], window[1:])
    expected = reference.greedy(text.prompts, text.greedy_tokens)
    for want, got in zip(expected, candidate.greedy(text.prompts, text.greedy_tokens), strict=True):
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
