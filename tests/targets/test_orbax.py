"""The `orbax` target as a user sees it: a checkpoint orbax restores, logits that agree with transformers,
int8 that is exactly the quantize stage's values, a sharding plan that holds on an 8-device mesh, and
clear errors for meshes and models it cannot serve."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core.errors import InvalidInput
from kiln.core.manifest import ArtifactManifest, FileEntry
from kiln.eval.metrics import compare
from kiln.eval.runtimes import JaxRuntime
from kiln.formats.architectures.record import TensorKind
from kiln.formats.hf_model import SourceModel, open_source
from kiln.quant.store import open_quantized
from kiln.targets.base import ExportRequest, get_target
from kiln.targets.orbax.layout import INT8, CheckpointTensor
from kiln.targets.orbax.sharding import HeadLayout, Mesh, plan_sharding
from tests.eval.orbax_models import export_orbax
from tests.model_factory import make_model

ROOT = Path(__file__).resolve().parents[2]
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(family="llama"),
    "qwen2-tied": dict(family="qwen2", tie_word_embeddings=True, seed=1),
}
IDS = list(range(3, 500, 7))  # 71 tokens: pads to a 128-token bucket


def _sharpen(model_dir: Path, tied: bool) -> None:
    """Peaked next-token distributions and position-dependent attention: a random model predicts almost
    uniformly, which would hide a wrong rope layout or a misplaced norm behind a tiny KL."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    # A tied head is also the input embedding, so a smaller factor already gives peaked distributions.
    head, head_factor = ("model.embed_tokens.weight", 7.0) if tied else ("lm_head.weight", 30.0)
    for name, t in tensors.items():
        qk = ".q_proj.weight" in name or ".k_proj.weight" in name
        factor = 10.0 if qk else head_factor if name == head else 1.0
        tensors[name] = (t.float() * factor).to(torch.bfloat16).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("orbax-models")
    out = {}
    for name, kw in FAMILIES.items():
        out[name] = make_model(root / name, **kw)
        _sharpen(out[name], kw.get("tie_word_embeddings", False))
    return out


@pytest.fixture(scope="module")
def exported(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """exported(family, quant) -> artifact directory, each exported once per module."""
    root = tmp_path_factory.mktemp("orbax-out")
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, quant: str) -> Path:
        if (family, quant) not in cache:
            export_orbax(models[family], root / f"{family}-{quant}", quant)
            cache[family, quant] = root / f"{family}-{quant}"
        return cache[family, quant]

    return get


def hf_logits(model_dir: Path, ids: list[int], state: dict[str, Any] | None = None) -> np.ndarray:
    """transformers' float32 logits of the model (with `state` replacing some of its weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        assert not model.load_state_dict(state, strict=False).unexpected_keys
    with torch.inference_mode():
        return np.asarray(model(torch.tensor([ids])).logits[0].numpy(), dtype=np.float32)


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --- what the artifact holds --------------------------------------------------------------------------


def test_artifact_holds_checkpoint_config_and_megatron_sharding_plan(models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "art"
    result = export_orbax(models["llama"], out, "bf16")
    assert result.files == sorted(_digests(out))
    assert {"config.json", "weights.json", "sharding.json", "tokenizer.json"} <= set(result.files)
    assert "checkpoint/_CHECKPOINT_METADATA" in result.files
    assert "checkpoint/state/model.layers.0.self_attn.q_proj.weight/zarr.json" in result.files
    assert (out / "config.json").read_bytes() == (models["llama"] / "config.json").read_bytes()
    # Every file is a valid manifest entry (orbax's underscore-led names included), as publish needs.
    ArtifactManifest(
        name="orbax-bf16",
        target="orbax",
        format="orbax-checkpoint",
        quant="bf16",
        hardware=list(result.hardware or {}),
        files=[FileEntry(path=f, sha256=d, size=(out / f).stat().st_size) for f, d in _digests(out).items()],
    )

    weights = json.loads((out / "weights.json").read_text())
    source = open_source(models["llama"])
    assert weights["quant"] == "bf16" and weights["checkpoint"] == "checkpoint"
    assert weights["tensors"] == {n: {"dtype": "bfloat16", "shape": list(t.shape)} for n, t in source.tensors.items()}

    sharding = json.loads((out / "sharding.json").read_text())
    assert sharding["mesh"] == {"data": 2, "model": 4} and sharding["tensor_parallel_axis"] == "model"
    specs = sharding["partition_specs"]
    layer = "model.layers.1."
    assert specs[layer + "self_attn.q_proj.weight"] == ["model", None]  # column parallel: output features
    assert specs[layer + "mlp.gate_proj.weight"] == specs[layer + "mlp.up_proj.weight"] == ["model", None]
    assert specs[layer + "self_attn.o_proj.weight"] == [None, "model"]  # row parallel: input features
    assert specs[layer + "mlp.down_proj.weight"] == [None, "model"]
    assert specs["model.embed_tokens.weight"] == specs["lm_head.weight"] == ["model", None]  # vocab parallel
    assert specs["model.norm.weight"] == [None]
    # 2 kv heads cannot split over 4 devices: replicated, as Megatron does, and said so.
    assert specs[layer + "self_attn.k_proj.weight"] == [None, None]
    assert "replicated" in sharding["notes"][layer + "self_attn.v_proj.weight"]

    assert set(result.hardware or {}) == {"tpu-v5e", "tpu-v5p"}
    assert "2x4 (data, model)" in (result.hardware or {})["tpu-v5e"]
    assert result.runtime["framework"] == "jax"


def test_checkpoint_holds_the_source_weights_bit_for_bit(models: dict[str, Path], exported: Callable) -> None:
    import torch
    from safetensors import safe_open

    art = exported("qwen2-tied", "bf16")
    rt = JaxRuntime(art)
    try:
        with safe_open(str(models["qwen2-tied"] / "model.safetensors"), framework="np") as f:
            names = list(f.keys())
        source = open_source(models["qwen2-tied"])
        params = rt.restore(list(json.loads((art / "weights.json").read_text())["tensors"]))
        assert sorted(params) == sorted(names)
        for name in names:
            want = source.tensor(name).view(torch.int16).numpy()
            assert np.array_equal(np.asarray(params[name]).view(np.int16), want), name
    finally:
        rt.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_agree_with_transformers(family: str, models: dict[str, Path], exported: Callable) -> None:
    ref = hf_logits(models[family], IDS)
    rt = JaxRuntime(exported(family, "bf16"))
    try:
        got = rt.logits(IDS)
        m = compare(ref[:-1], got[:-1], IDS[1:])
        print(f"\norbax bf16 {family} vs transformers: {m.model_dump_json()}")
        assert got.shape == ref.shape and got.dtype == np.float32
        assert m.top1 >= 0.99 and m.kl <= 1e-6 and abs(m.ppl_change) <= 1e-4
        assert np.abs(got - ref).max() < 1e-3
        # The sharpened model is confident (entropy far below uniform's), so agreement here is not luck.
        logp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
        assert float(-(np.exp(logp) * logp).sum(-1).mean()) < 0.5 * np.log(ref.shape[1])
    finally:
        rt.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_computes_the_quantize_stage_model(family: str, models: dict[str, Path], exported: Callable) -> None:
    """The int8 checkpoint holds the quantize stage's values as int8 + per-channel float32 scales, and the
    forward computes exactly the model whose Linear weights are q * scale."""
    import torch

    from kiln.quant.rtn import dequantize, quantizes

    art = exported(family, INT8)
    quantized = open_quantized(art.parent / f"{art.name}-quantize", INT8)
    source = open_source(models[family])
    rt = JaxRuntime(art)
    try:
        params = rt.restore(list(json.loads((art / "weights.json").read_text())["tensors"]))
        state = {}
        for name in source.tensors:
            if not quantizes(quantized.scheme, name):
                assert str(params[name].dtype) == "bfloat16"
                continue
            module = name.removesuffix(".weight")
            weight = dequantize(
                quantized.scheme, module, {q: quantized.tensor(q) for q in quantized.module_tensors(name)}
            )
            q, scale = np.asarray(params[name]), np.asarray(params[module + ".weight_scale"])
            assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (q.shape[0],)
            np.testing.assert_array_equal(q.astype(np.float32) * scale[:, None], weight.numpy())
            state[name] = weight
        assert len(state) == 7 * source.shape.num_layers

        got = rt.logits(IDS)
        exact = compare(hf_logits(models[family], IDS, state)[:-1], got[:-1], IDS[1:])
        assert exact.kl <= 1e-6 and exact.top1 >= 0.99  # the dequantized model, computed in JAX
        vs_bf16 = compare(hf_logits(models[family], IDS)[:-1], got[:-1], IDS[1:])
        print(f"\norbax {INT8} {family} vs bf16 transformers: {vs_bf16.model_dump_json()}")
        assert 0 < vs_bf16.kl <= 0.015 and vs_bf16.top1 >= 0.9
        assert torch.isfinite(torch.from_numpy(got)).all()
    finally:
        rt.close()
    # One byte per weight on disk (bf16 takes two, less what zstd finds in its exponents).
    up = art / "checkpoint" / "state" / "model.layers.0.mlp.up_proj.weight"
    assert sum(p.stat().st_size for p in up.rglob("*") if p.is_file()) <= np.prod(source.tensors[up.name].shape) + 1024


# --- the sharding plan on a mesh ------------------------------------------------------------------------

MESH_CHECK = """
import json, sys
import numpy as np
from kiln.eval.runtimes import JaxRuntime

ids = list(range(3, 500, 7))
out = {}
for art in sys.argv[1:]:
    rt = JaxRuntime(art, mesh=True, resident_bytes=0)  # restored layer by layer onto the mesh
    plan = json.load(open(art + "/sharding.json"))
    tp = plan["mesh"]["model"]
    params = rt.restore(list(plan["partition_specs"]))
    wrong = []
    for name, spec in plan["partition_specs"].items():
        arr = params[name]
        want = tuple(d // tp if s == "model" else d for d, s in zip(arr.shape, spec))
        got_spec = tuple(arr.sharding.spec) + (None,) * (len(spec) - len(arr.sharding.spec))
        if got_spec != tuple(spec) or arr.addressable_shards[0].data.shape != want:
            wrong.append(name)
    expected = np.load(art + "-expected.npz")
    out[art] = {
        "devices": len(params["model.norm.weight"].sharding.device_set),
        "mesh": dict(rt.mesh.shape),
        "wrong": wrong,
        "max_abs": float(np.abs(rt.logits(ids) - expected["logits"]).max()),
        # Decoding on a KV cache the mesh holds; once is enough (each new program compiles for 8 devices).
        "greedy_same": art != sys.argv[1] or rt.greedy([ids[:12]], 6)[0] == expected["greedy"].tolist(),
    }
print(json.dumps(out))
"""


def test_sharding_plan_restores_on_an_8_device_mesh(exported: Callable) -> None:
    """A fresh process with 8 CPU devices restores each array with the NamedSharding its plan names and,
    restoring one layer at a time, computes the same logits and greedy tokens as one device: the plan is one
    XLA can run. (int8 llama: replicated kv heads and int8 scales; bf16 qwen2: q/k/v biases and a tied head
    split on the vocabulary.)"""
    arts = [exported("llama", INT8), exported("qwen2-tied", "bf16")]
    for art in arts:
        rt = JaxRuntime(art)
        np.savez(f"{art}-expected.npz", logits=rt.logits(IDS), greedy=np.array(rt.greedy([IDS[:12]], 6)[0]))
        rt.close()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", MESH_CHECK, *map(str, arts)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for art in arts:
        r = result[str(art)]
        assert r["devices"] == 8 and r["mesh"] == {"data": 2, "model": 4}, r
        assert r["wrong"] == [], r
        assert r["max_abs"] < 1e-3 and r["greedy_same"], r


def test_plan_splits_embeddings_on_hidden_when_the_vocabulary_does_not_divide() -> None:
    shapes = {
        CheckpointTensor("model.embed_tokens.weight", "bfloat16", (1001, 64), TensorKind.TOKEN_EMBD),
        CheckpointTensor("lm_head.weight", "bfloat16", (1001, 64), TensorKind.OUTPUT),
        CheckpointTensor("model.norm.weight", "bfloat16", (64,), TensorKind.OUTPUT_NORM),
    }
    tensors = {t.name: t for t in shapes}
    specs, notes = plan_sharding(tensors, HeadLayout(4, 4, 16), Mesh.parse({"model": 4}))
    assert specs["model.embed_tokens.weight"] == (None, "model") and "1001" in notes["lm_head.weight"]
    specs, _ = plan_sharding(tensors, HeadLayout(4, 4, 16), Mesh.parse({"data": 8, "model": 1}))
    assert set(specs.values()) == {(None, None), (None,)}  # no tensor parallelism: every weight whole


@pytest.mark.parametrize(
    ("params", "code", "named"),
    [
        ({"mesh": {"data": 1, "model": 8}}, "ORBAX_SHARDING_NOT_DIVISIBLE", "'model.layers.0.self_attn.q_proj.weight'"),
        ({"mesh": {"data": 2, "model": 3}}, "ORBAX_SHARDING_NOT_DIVISIBLE", "'model.embed_tokens.weight'"),
        ({"mesh": {"data": 8}}, "ORBAX_MESH_INVALID", "no 'model' axis"),
        ({"mesh": {"data": 2, "model": 0}}, "ORBAX_MESH_INVALID", "positive integer"),
        ({"mesh": [2, 4]}, "ORBAX_MESH_INVALID", "mapping"),
        ({"meshes": {"model": 4}}, "INVALID_INPUT", "unknown param"),
    ],
)
def test_a_mesh_the_model_does_not_fit_is_refused_before_writing(
    params: dict[str, Any], code: str, named: str, models: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(InvalidInput) as e:
        export_orbax(models["llama"], tmp_path / "art", "bf16", **params)
    assert e.value.code == code and named in e.value.message, e.value.message
    assert list((tmp_path / "art").iterdir()) == []
    if code == "ORBAX_SHARDING_NOT_DIVISIBLE":
        assert e.value.details["tensor"] in named and e.value.details["axis"] == "model"


def test_a_bad_mesh_is_refused_when_the_recipe_is_read(models: dict[str, Path], tmp_path: Path) -> None:
    from kiln.core.errors import RecipeInvalid
    from kiln.pipeline.recipe import parse_recipe

    (tmp_path / "heldout.txt").write_text("text")
    recipe = {
        "model": "m",
        "version": "1",
        "source": str(models["llama"]),
        "eval": {"text": "heldout.txt"},
        "targets": [{"target": "orbax", "quants": ["bf16"], "params": {"mesh": {"data": 8}}}],
    }
    with pytest.raises(RecipeInvalid, match="no 'model' axis"):
        parse_recipe(recipe, base_dir=tmp_path)
    recipe["targets"] = [{"target": "orbax", "quants": ["bf16"], "hardware": ["h100"]}]
    with pytest.raises(RecipeInvalid, match="orbax-bf16 cannot serve h100: .*hf-bundles"):
        parse_recipe(recipe, base_dir=tmp_path)


# --- streaming, reproducibility, refusals ---------------------------------------------------------------


@pytest.mark.parametrize("budget_tensors", [0, 3])
def test_export_streams_in_bounded_batches(
    budget_tensors: int, models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the k-th source tensor is read, the tensors read before it and not yet in the checkpoint on
    disk hold fewer bytes than the write batch (`WRITE_BATCH_BYTES`): memory is one batch, not the model."""
    from kiln.targets.orbax import export as orbax_export

    out = tmp_path / "art"
    out.mkdir()

    @dataclasses.dataclass
    class Watched(SourceModel):
        on_disk: list[int] = dataclasses.field(default_factory=list)

        def tensor(self, name: str) -> Any:
            self.on_disk.append(sum(1 for _ in out.rglob("zarr.json")))
            return super().tensor(name)

    src = open_source(models["llama"])
    sizes = [t.nbytes for t in src.tensors.values()]
    budget = max(1, budget_tensors * max(sizes))
    monkeypatch.setattr(orbax_export, "WRITE_BATCH_BYTES", budget)
    watched = Watched(**{f.name: getattr(src, f.name) for f in dataclasses.fields(SourceModel)})
    get_target("orbax").export(watched, ExportRequest(quant="bf16", out_dir=out))
    assert len(watched.on_disk) == len(sizes)
    for k, written in enumerate(watched.on_disk):
        assert sum(sizes[written:k]) < budget, (k, written)
    if budget == 1:  # one save per tensor: each is on disk before the next is read
        assert watched.on_disk == list(range(len(sizes)))
    else:
        assert watched.on_disk[-1] < len(sizes) - 1  # batched: fewer saves than tensors


def test_exports_are_byte_for_byte_reproducible(models: dict[str, Path], tmp_path: Path) -> None:
    export_orbax(models["qwen2-tied"], tmp_path / "a", "bf16")
    export_orbax(models["qwen2-tied"], tmp_path / "b" / "elsewhere", "bf16")
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b" / "elsewhere")


def test_models_the_forward_would_compute_differently_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "scaled"
    shutil.copytree(models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidInput) as e:
        export_orbax(model, tmp_path / "art", "bf16")
    assert e.value.code == "ORBAX_UNSUPPORTED" and "llama3" in e.value.message
    assert list((tmp_path / "art").iterdir()) == []


def test_mistral_sliding_window_matches_transformers(tmp_path: Path) -> None:
    model = make_model(tmp_path / "mistral", "mistral", seed=2)
    _sharpen(model, tied=False)
    ids = IDS[:40]
    full = hf_logits(model, ids)
    config = json.loads((model / "config.json").read_text())
    config["sliding_window"] = 8
    (model / "config.json").write_text(json.dumps(config))
    windowed = hf_logits(model, ids)
    assert np.abs(windowed - full).max() > 1e-2  # the window changes what transformers computes
    export_orbax(model, tmp_path / "art", "bf16")
    rt = JaxRuntime(tmp_path / "art")
    try:
        got = rt.logits(ids)
        assert compare(windowed[:-1], got[:-1], ids[1:]).kl <= 1e-6
        assert np.abs(got - windowed).max() < 1e-3
    finally:
        rt.close()


def test_pipeline_builds_and_evaluates_orbax_through_the_eval_stage(models: dict[str, Path], tmp_path: Path) -> None:
    """A recipe with orbax bf16 and int8: the int8 export consumes the shared quantize stage, the eval stage
    opens both in the JAX runtime and judges them with the default gates, and each records TPU hardware."""
    from kiln.pipeline.build import run
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.records import ArtifactRecord
    from kiln.pipeline.store import WorkDir

    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    (tmp_path / "heldout.txt").write_text(text, encoding="utf-8")
    recipe_path = tmp_path / "kiln.yaml"
    recipe_path.write_text(
        f"model: tiny\nversion: 1.0.0\nsource: {models['llama']}\n"
        "eval: {text: heldout.txt, max_tokens: 256, window: 64, greedy_prompts: 2, greedy_tokens: 8}\n"
        f"targets:\n  - target: orbax\n    quants: [bf16, {INT8}]\n    params: {{mesh: {{data: 4, model: 2}}}}\n"
    )
    result = run(load_recipe(recipe_path, allowed_roots=[models["llama"]]), WorkDir(tmp_path / "work"))
    rows = {r.artifact: r for r in result.artifacts()}
    assert set(rows) == {"orbax-bf16", f"orbax-{INT8}"}
    for name, row in rows.items():
        assert row.export == "built" and row.eval == "passed", row
        export = result.outcomes[f"export/{name}"].output
        assert export is not None
        record = export.record(ArtifactRecord)
        assert record.hardware == ["tpu-v5e", "tpu-v5p"] and record.runtime_name == "jax"
        assert record.runtime["mesh"] == {"data": 4, "model": 2}
        assert "GGUF" in record.unsupported["cpu"] and "hf-bundles" in record.unsupported["h100"]
    assert (metrics := rows["orbax-bf16"].metrics) is not None and metrics.kl <= 1e-6
    assert f"quantize/{INT8}" in result.outcomes


def test_export_into_a_relative_directory(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default work dir (.kiln/work) is relative; orbax itself only takes absolute destinations."""
    monkeypatch.chdir(tmp_path)
    result = export_orbax(models["llama"], Path("relative-out"), "bf16")
    assert (tmp_path / "relative-out" / "checkpoint").is_dir() and result.files
