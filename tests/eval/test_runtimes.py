"""The reference (transformers) and llama.cpp runtimes compute the same function on the same ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InvalidInput, StageFailed
from kiln.eval.gates import Gate, gate_for
from kiln.eval.metrics import compare
from kiln.eval.run import evaluate, evaluate_artifact, measure
from kiln.eval.runtimes import CachedRuntime, LlamaCppRuntime, Runtime, TransformersRuntime
from kiln.eval.text import EvalText
from tests.eval.gguf_fixture import write_llama_gguf


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module", params=["f32", "f16"])
def llama_cpp(request: pytest.FixtureRequest, llama_dir: Path, gguf_dir: Path) -> Iterator[LlamaCppRuntime]:
    path = write_llama_gguf(llama_dir, gguf_dir / f"model-{request.param}.gguf", dtype=request.param)
    rt = LlamaCppRuntime(path, n_ctx=256)
    rt.quant = request.param  # type: ignore[attr-defined]
    yield rt
    rt.close()


# --- the reference -----------------------------------------------------------------------------


def test_reference_is_a_float32_forward_of_the_checkpoint(llama_dir: Path, reference: CachedRuntime) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert isinstance(reference, Runtime) and reference.name == "transformers"
    ids = [0, 5, 77, 300, 12, 511, 9, 9]
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = reference.logits(ids)
    assert got.dtype == np.float32 and got.shape == (8, 512)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    with torch.no_grad():  # and not a bf16-math forward, which rounds every activation
        bf16 = model.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float().numpy()
    assert np.abs(got - bf16).max() > 1e-3


def test_reference_greedy_is_argmax_decoding(reference: CachedRuntime, eval_text: EvalText) -> None:
    prompts = [list(p) for p in eval_text.prompts[:3]]
    got = reference.greedy(prompts, 8)  # equal lengths: decoded as one batch
    for prompt, tokens in zip(prompts, got, strict=True):
        seq = list(prompt)
        for _ in range(8):
            seq.append(int(np.argmax(reference.runtime.logits(seq)[-1])))
        assert tokens == seq[len(prompt) :]
    assert reference.runtime.greedy([prompts[1][:5], prompts[0]], 3) == [
        reference.runtime.greedy([prompts[1][:5]], 3)[0],
        got[0][:3],
    ]


def test_reference_against_itself_is_perfect(reference: CachedRuntime, eval_text: EvalText) -> None:
    report = evaluate(reference, reference, eval_text, gate_for("f32", {"min_greedy_match": 1.0}))
    m = report.metrics
    assert m is not None and report.status == "passed"
    assert m.kl == 0.0 and m.top1 == 1.0 and m.ppl_change == 0.0
    assert m.greedy_match == 1.0 and m.greedy_tokens == 64 and m.tokens == eval_text.tokens
    assert report.text_digest == eval_text.digest and report.reference == "transformers"


def test_reference_logits_are_computed_once(llama_dir: Path, eval_text: EvalText, tmp_path: Path) -> None:
    inner = TransformersRuntime(llama_dir)
    in_memory = CachedRuntime(inner)
    measure(in_memory, in_memory, eval_text)
    # Each window once, each prompt's continuation once, and (transformers is teacher-forced) each prompt with
    # that continuation once.
    assert in_memory.computed == len(eval_text.windows) + 2 * len(eval_text.prompts)
    on_disk = CachedRuntime(inner, tmp_path / "ref", identity="source-digest")
    first = [np.array(on_disk.logits(w)) for w in eval_text.windows[:2]]
    again = CachedRuntime(inner, tmp_path / "ref", identity="source-digest")  # a later run, same dir
    assert all(np.array_equal(a, again.logits(w)) for a, w in zip(first, eval_text.windows, strict=False))
    assert again.greedy(eval_text.prompts[:1], 4) == in_memory.greedy(eval_text.prompts[:1], 4)
    assert again.computed == 1  # only the greedy call, which this directory had not seen
    assert not list((tmp_path / "ref").glob(".tmp-*"))
    other_model = CachedRuntime(inner, tmp_path / "ref", identity="another-digest")
    other_model.logits(eval_text.windows[0])
    assert other_model.computed == 1


def test_reference_rejects_ids_outside_the_vocab(reference: CachedRuntime) -> None:
    with pytest.raises(InvalidInput, match="outside the vocab"):
        reference.runtime.logits([1, 512])


# --- llama.cpp -----------------------------------------------------------------------------------


def test_llama_cpp_agrees_with_reference(
    llama_cpp: LlamaCppRuntime, reference: CachedRuntime, eval_text: EvalText
) -> None:
    quant = llama_cpp.quant  # type: ignore[attr-defined]
    report = evaluate(reference, llama_cpp, eval_text, gate_for(quant))
    m = report.metrics
    assert m is not None
    print(f"\nllama.cpp {quant} vs reference: {m.model_dump_json()}")
    assert report.status == "passed", report.failures
    assert report.runtime == "llama.cpp" and (report.runtime_version or "").startswith("llama-cpp-python 0.3")
    assert m.top1 >= 0.99 and m.kl <= 1e-4 and abs(m.ppl_change) <= 1e-3
    assert m.greedy_match == 1.0  # every prompt continued identically for 16 tokens


def test_llama_cpp_windows_are_independent(llama_cpp: LlamaCppRuntime, eval_text: EvalText) -> None:
    w0, w1 = eval_text.windows[0], eval_text.windows[1]
    fresh = llama_cpp.logits(w1)
    llama_cpp.logits(w0)
    llama_cpp.greedy([w0[:16]], 8)
    assert np.array_equal(llama_cpp.logits(w1), fresh)
    assert np.array_equal(llama_cpp.logits(w1[:10]), fresh[:10])  # a shorter window after a longer one


def test_llama_cpp_adds_no_bos(llama_cpp: LlamaCppRuntime, reference: CachedRuntime, eval_text: EvalText) -> None:
    ids = list(eval_text.windows[2][1:40])  # no BOS: llama.cpp must not put one in front
    assert ids[0] != eval_text.bos_token_id
    ref, got = reference.logits(ids), llama_cpp.logits(ids)
    assert got.shape == ref.shape
    assert compare(ref[:-1], got[:-1], ids[1:]).kl < 1e-4
    assert np.argmax(got[0]) == np.argmax(ref[0])


def test_llama_cpp_rejects_what_it_cannot_run(llama_cpp: LlamaCppRuntime, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="outside the vocab"):
        llama_cpp.logits([1, 2, 512])
    with pytest.raises(InvalidInput, match="do not fit"):
        llama_cpp.logits([1] * 257)
    with pytest.raises(InvalidInput, match="do not fit"):
        llama_cpp.greedy([[1] * 250], 8)
    with pytest.raises(InvalidInput, match="does not exist"):
        LlamaCppRuntime(tmp_path / "missing.gguf")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(StageFailed) as e:
        LlamaCppRuntime(tmp_path / "garbage.gguf")
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED"


def test_padded_vocab_is_compared_on_the_model_vocab(
    llama_dir: Path, gguf_dir: Path, reference: CachedRuntime, eval_text: EvalText
) -> None:
    path = write_llama_gguf(llama_dir, gguf_dir / "padded.gguf", pad_vocab=32)
    report = evaluate_artifact(reference, "llama.cpp", path, eval_text, gate_for("f32"))
    assert report.status == "passed", report.failures
    assert report.metrics is not None and report.metrics.greedy_match == 1.0
    with LlamaCppRuntimeCtx(path, eval_text) as rt:
        logits = rt.logits(eval_text.windows[0])
        assert logits.shape[1] == 544  # llama.cpp returns the padded columns ...
        # ... which would win the argmax at some positions if they were not cut off.
        assert (logits[:, 512:].max(axis=1) > logits[:, :512].max(axis=1)).any()


def test_broken_conversion_fails_its_gate(
    llama_dir: Path, gguf_dir: Path, reference: CachedRuntime, eval_text: EvalText
) -> None:
    path = write_llama_gguf(llama_dir, gguf_dir / "no-permute.gguf", permute_qk=False)
    report = evaluate_artifact(reference, "llama.cpp", path, eval_text, gate_for("q4_0"))
    assert report.status == "failed" and not report.passed
    assert [f.split()[0] for f in report.failures] == ["kl", "top1"]


def test_runtime_not_here_is_not_evaluated(reference: CachedRuntime, eval_text: EvalText, tmp_path: Path) -> None:
    report = evaluate_artifact(reference, "tensorrt_llm", tmp_path, eval_text, Gate(max_kl=0.01))
    assert report.status == "not_evaluated" and not report.passed
    assert report.runtime_needed == "tensorrt_llm" and "GPU runner" in (report.reason or "")
    unknown = evaluate_artifact(reference, "no-such-runtime", tmp_path, eval_text, Gate(max_kl=0.01))
    assert unknown.status == "not_evaluated" and "not available" in (unknown.reason or "")


class LlamaCppRuntimeCtx:
    """Open and always close a llama.cpp runtime sized for `text`."""

    def __init__(self, path: Path, text: EvalText) -> None:
        self.rt = LlamaCppRuntime(path, n_ctx=text.context_needed)

    def __enter__(self) -> LlamaCppRuntime:
        return self.rt

    def __exit__(self, *exc: object) -> None:
        self.rt.close()


def test_kiln_gguf_export_agrees_with_reference(
    llama_dir: Path, tmp_path: Path, reference: CachedRuntime, eval_text: EvalText
) -> None:
    from kiln.formats.hf_model import open_source
    from kiln.targets.base import ExportRequest, get_target

    target = get_target("gguf")
    assert target.runtime == "llama.cpp"
    result = target.export(open_source(llama_dir), ExportRequest(quant="f16", out_dir=tmp_path))
    report = evaluate_artifact(reference, target.runtime, tmp_path / result.files[0], eval_text, gate_for("f16"))
    assert report.status == "passed", report.failures
    assert report.metrics is not None and report.metrics.top1 >= 0.99 and report.metrics.greedy_match == 1.0
