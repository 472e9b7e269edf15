"""The eval report as published: JSON round trip, consistent verdicts, readable without numpy."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from kiln.core import evals as core_evals
from kiln.eval import gates as eval_gates
from kiln.eval.gates import gate_for
from kiln.eval.report import EvalMetrics, EvalReport, judged

METRICS = EvalMetrics(
    tokens=255, windows=1, vocab_size=512, ppl_ref=10.0, ppl=10.2, ppl_change=0.02, kl=0.01, kl_max=0.2,
    top1=0.95, greedy_tokens=32, greedy_match=0.5, greedy_match_total=0.75,
)  # fmt: skip


def test_judged_report_round_trips_through_json() -> None:
    report = judged(METRICS, gate_for("q4_k_m"), runtime="llama.cpp", runtime_version="0.3.36")
    assert report.status == "passed" and report.passed
    again = EvalReport.model_validate_json(report.model_dump_json())
    assert again == report
    failed = judged(METRICS, gate_for("f16"), runtime="llama.cpp", runtime_version="0.3.36")
    assert failed.status == "failed" and not failed.passed and failed.failures


def test_non_finite_metrics_survive_json() -> None:
    broken = METRICS.model_copy(update={"kl": math.nan, "ppl": math.inf})
    report = judged(broken, gate_for("q4_0"), runtime="llama.cpp", runtime_version="x")
    again = EvalReport.model_validate_json(report.model_dump_json())
    assert again.metrics is not None and math.isnan(again.metrics.kl) and again.metrics.ppl == math.inf
    assert again.status == "failed"


# A failed report as kiln wrote it before its record moved to core.evals: it reads back, and is written the same.
STORED = (
    '{"status":"failed","passed":false,"runtime":"llama.cpp","runtime_version":"0.3.36","reference":null,'
    '"reference_version":null,"text_digest":"' + "ab" * 32 + '","metrics":{"tokens":255,"windows":1,'
    '"vocab_size":512,"ppl_ref":10.0,"ppl":"Infinity","ppl_change":0.02,"kl":"NaN","kl_error":0.0,"kl_max":0.2,'
    '"top1":0.95,"greedy_tokens":32,"greedy_match":0.5,"greedy_match_total":0.75},"gate":{"max_kl":0.06,'
    '"min_top1":0.85,"max_ppl_increase":0.08,"min_greedy_match":null},"failures":["kl nan is above max_kl 0.06"],'
    '"runtime_needed":null,"reason":null}'
)


def test_a_stored_report_reads_and_writes_as_before() -> None:
    report = EvalReport.model_validate_json(STORED)
    assert report.model_dump_json() == STORED
    broken = METRICS.model_copy(update={"kl": math.nan, "ppl": math.inf})
    again = judged(broken, gate_for("q4_k_m"), runtime="llama.cpp", runtime_version="0.3.36", text_digest="ab" * 32)
    assert again.model_dump_json() == STORED
    # One record under both names: eval's, where the pipeline reads it, and core's, where the registry does.
    assert (EvalReport, EvalMetrics, eval_gates.Gate) == (
        core_evals.EvalReport,
        core_evals.EvalMetrics,
        core_evals.Gate,
    )


def test_not_evaluated_is_never_passed() -> None:
    report = EvalReport.not_evaluated("tensorrt_llm", "needs an NVIDIA GPU runner")
    assert report.status == "not_evaluated" and not report.passed and report.metrics is None
    assert EvalReport.model_validate_json(report.model_dump_json()) == report
    with pytest.raises(ValidationError, match="never passed"):
        EvalReport(status="not_evaluated", passed=True, runtime_needed="x", reason="y")
    with pytest.raises(ValidationError, match="runtime_needed"):
        EvalReport(status="not_evaluated", passed=False)


def test_contradictory_reports_are_refused() -> None:
    gate = gate_for("q8_0")
    with pytest.raises(ValidationError, match="contradicts"):
        EvalReport(status="passed", passed=False, runtime="r", metrics=METRICS, gate=gate, failures=["x"])
    with pytest.raises(ValidationError, match="says why"):
        EvalReport(status="failed", passed=False, runtime="r", metrics=METRICS, gate=gate)
    with pytest.raises(ValidationError, match="carries runtime"):
        EvalReport(status="passed", passed=True, gate=gate)


def test_gates_and_reports_import_without_numpy_or_torch() -> None:
    # The registry's base install has neither; it must still read reports.
    code = (
        "import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None\n"
        "import kiln.eval.report, kiln.eval.gates\n"
        "print(kiln.eval.gates.gate_for('q8_0').max_kl)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.005"
