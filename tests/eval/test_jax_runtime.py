"""The JAX runtime (the orbax target's) computes the reference's function on the same ids, through the same eval."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import InvalidInput, StageFailed
from kiln.eval.gates import gate_for
from kiln.eval.metrics import compare
from kiln.eval.run import evaluate, evaluate_artifact
from kiln.eval.runtimes import CachedRuntime, JaxRuntime, Runtime, open_runtime
from kiln.eval.runtimes.jax_runtime import bucket
from kiln.eval.text import EvalText
from kiln.formats.hf_model import open_source
from kiln.targets.base import ExportRequest, get_target


@pytest.fixture(scope="module")
def orbax_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("orbax") / "orbax-bf16"
    out.mkdir()
    get_target("orbax").export(open_source(llama_dir), ExportRequest(quant="bf16", out_dir=out))
    return out


@pytest.fixture(scope="module")
def jax_rt(orbax_dir: Path) -> Iterator[JaxRuntime]:
    rt = JaxRuntime(orbax_dir)
    yield rt
    rt.close()


def test_jax_runtime_agrees_with_reference(jax_rt: JaxRuntime, reference: CachedRuntime, eval_text: EvalText) -> None:
    assert isinstance(jax_rt, Runtime) and get_target("orbax").runtime == jax_rt.name == "jax"
    report = evaluate(reference, jax_rt, eval_text, gate_for("bf16", {"min_greedy_match": 1.0}))
    m = report.metrics
    assert m is not None
    print(f"\njax float32 vs reference: {m.model_dump_json()}")
    assert report.status == "passed", report.failures
    assert (report.runtime_version or "").startswith("jax 0.10") and "orbax-checkpoint" in (
        report.runtime_version or ""
    )
    assert m.top1 >= 0.99 and m.kl <= 1e-6 and abs(m.ppl_change) <= 1e-4 and m.greedy_match == 1.0


def test_bfloat16_activations_round_more_but_stay_close(
    orbax_dir: Path, reference: CachedRuntime, eval_text: EvalText
) -> None:
    """bf16 activations, as a TPU serving stack computes: measurably more rounding than the float32 default,
    still within the bf16 gate's KL on this random model (whose near-ties cost it some top-1 agreement)."""
    report = evaluate_artifact(reference, "jax", orbax_dir, eval_text, gate_for("bf16"), compute_dtype="bfloat16")
    m = report.metrics
    assert m is not None
    print(f"\njax bfloat16 vs reference: {m.model_dump_json()}")
    assert 1e-6 < m.kl <= 1e-3 and m.top1 >= 0.97


def test_padding_and_earlier_calls_do_not_change_logits(jax_rt: JaxRuntime, eval_text: EvalText) -> None:
    w0, w1 = eval_text.windows[0], eval_text.windows[1]
    fresh = jax_rt.logits(w1)
    jax_rt.logits(w0)
    jax_rt.greedy([w0[:16]], 8)
    assert np.array_equal(jax_rt.logits(w1), fresh)
    short = jax_rt.logits(w1[:10])  # padded to another bucket: the padding after the tokens is invisible
    assert short.shape == (10, 512)
    np.testing.assert_allclose(short, fresh[:10], rtol=0, atol=1e-4)
    assert [bucket(n) for n in (1, 16, 17, 128, 129)] == [16, 16, 32, 128, 256]


def test_greedy_on_the_kv_cache_is_argmax_decoding(
    jax_rt: JaxRuntime, reference: CachedRuntime, eval_text: EvalText
) -> None:
    prompt = list(eval_text.prompts[2])
    [got] = jax_rt.greedy([prompt], 12)
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(np.argmax(jax_rt.logits(seq)[-1])))
    assert got == seq[len(prompt) :] == reference.greedy([prompt], 12)[0]
    assert jax_rt.greedy([prompt], 0) == [[]]


def test_a_streamed_checkpoint_computes_what_a_resident_one_does(
    jax_rt: JaxRuntime, orbax_dir: Path, eval_text: EvalText, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint above `resident_bytes` is restored piece by piece for every pass, never more than one
    decoder layer (or the embedding, or the final norm and the head) at a time, and computes the same logits
    and greedy tokens bit for bit: the same programs run on the same arrays."""
    streamed = JaxRuntime(orbax_dir, resident_bytes=0)
    calls: list[list[str]] = []
    restore = streamed.restore
    monkeypatch.setattr(streamed, "restore", lambda names: calls.append(list(names)) or restore(names))
    try:
        assert "restored one layer at a time" in streamed.version and "restored whole" in jax_rt.version
        windows = [eval_text.windows[0], eval_text.windows[1][:40], eval_text.windows[2]]
        for got, want in zip(streamed.logits_many(windows), jax_rt.logits_many(windows), strict=True):
            assert np.array_equal(got, want)
        n_layers = streamed.config.shape.num_layers
        assert len(calls) == n_layers + 2  # the embedding, each layer once for every window, the norm and head
        prompts = [list(eval_text.prompts[0]), list(eval_text.prompts[2][:7])]
        assert streamed.greedy(prompts, 6) == jax_rt.greedy(prompts, 6)
        for names in calls:
            layers = {n.split(".")[2] if n.startswith("model.layers.") else None for n in names}
            assert (
                len(layers) == 1
                and None not in layers
                or sorted(names)
                in (
                    ["model.embed_tokens.weight"],
                    ["lm_head.weight", "model.norm.weight"],
                )
            ), names
        assert len(calls) == (n_layers + 2) * 7  # the windows' pass, then 6 tokens' passes (prefill included)
    finally:
        streamed.close()


def test_jax_runtime_adds_no_bos(jax_rt: JaxRuntime, reference: CachedRuntime, eval_text: EvalText) -> None:
    ids = list(eval_text.windows[2][1:40])
    assert ids[0] != eval_text.bos_token_id
    assert compare(reference.logits(ids)[:-1], jax_rt.logits(ids)[:-1], ids[1:]).kl < 1e-6


def test_jax_runtime_rejects_what_it_cannot_run(jax_rt: JaxRuntime, orbax_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="outside the vocab"):
        jax_rt.logits([1, 2, 512])
    with pytest.raises(InvalidInput, match="not a directory"):
        JaxRuntime(tmp_path / "missing")
    with pytest.raises(InvalidInput, match="compute_dtype"):
        JaxRuntime(orbax_dir, compute_dtype="float16")  # type: ignore[arg-type]

    broken = tmp_path / "broken"
    shutil.copytree(orbax_dir, broken)
    (broken / "weights.json").unlink()
    with pytest.raises(StageFailed) as e:
        JaxRuntime(broken)
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED" and "weights.json" in e.value.message

    newer = tmp_path / "newer"
    shutil.copytree(orbax_dir, newer)
    weights = json.loads((newer / "weights.json").read_text())
    (newer / "weights.json").write_text(json.dumps({**weights, "format_version": 99}))
    with pytest.raises(StageFailed, match="version 99"):
        JaxRuntime(newer)

    partial = tmp_path / "partial"  # weights.json and sharding.json agree, but a layer's tensor is gone
    shutil.copytree(orbax_dir, partial)
    for name in ("weights.json", "sharding.json"):
        doc = json.loads((partial / name).read_text())
        table = doc["tensors"] if name == "weights.json" else doc["partition_specs"]
        del table["model.layers.1.mlp.up_proj.weight"]
        (partial / name).write_text(json.dumps(doc))
    with pytest.raises(StageFailed) as e:
        JaxRuntime(partial)
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED" and "lacks model.layers.1.mlp.up_proj.weight" in e.value.message

    tampered = tmp_path / "tampered"
    shutil.copytree(orbax_dir, tampered)
    weights = json.loads((tampered / "weights.json").read_text())
    weights["tensors"]["model.norm.weight"]["dtype"] = "float32"  # orbax would cast silently
    (tampered / "weights.json").write_text(json.dumps(weights))
    with pytest.raises(StageFailed) as e:
        JaxRuntime(tampered)
    assert e.value.code == "EVAL_RUNTIME_LOAD_FAILED" and "'model.norm.weight'" in e.value.message


def test_a_mesh_this_machine_lacks_is_not_evaluated(
    orbax_dir: Path, reference: CachedRuntime, eval_text: EvalText
) -> None:
    """The artifact's 2x4 mesh needs 8 devices; with one CPU device the sharded eval is deferred, never passed."""
    report = evaluate_artifact(reference, "jax", orbax_dir, eval_text, gate_for("bf16"), mesh=True)
    assert report.status == "not_evaluated" and not report.passed
    assert report.runtime_needed == "jax on 8 devices" and "needs 8 devices" in (report.reason or "")
    assert isinstance(open_runtime("jax", orbax_dir), JaxRuntime)
