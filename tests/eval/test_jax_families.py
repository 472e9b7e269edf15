"""The orbax target and its JAX forward on the families beyond Llama: each tiny model exported, restored by the JAX
runtime and compared with transformers (logits by KL, greedy continuations), with the feature that sets the family
apart switched on and shown to change what transformers computes; the stacked-expert and split layouts checked
against the source, bit for bit, and in int8 against the quantize stage's values; experts split over a mesh."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.core.errors import InvalidInput
from kiln.eval.metrics import compare
from kiln.eval.runtimes import JaxRuntime, TransformersRuntime
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.hf_model import open_source
from kiln.targets.orbax.layout import INT8, QUANTS, checkpoint_tensors, plan_checkpoint
from kiln.targets.orbax.sharding import HeadLayout, Mesh, plan_sharding
from tests.eval.orbax_models import dequantized_model, entropy, exports, on_an_8_device_mesh
from tests.eval.orbax_models import references as opened_references
from tests.model_factory import make_model, sharpen

IDS = list(range(3, 500, 7))  # 71 tokens: longer than every window below, padded to a 128-token bucket
WINDOW = 16
# Per family: the tiny model's config beyond model_factory's, and the keys whose removal must change transformers'
# logits (the feature is live in this model, so agreeing with transformers tests it).
CASES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    # Layer 0 full attention, layer 1 a window: per-layer windows, and q/k norms.
    "qwen3": (
        dict(use_sliding_window=True, max_window_layers=1, sliding_window=WINDOW),
        ("use_sliding_window", "layer_types"),
    ),
    "qwen3_moe": ({}, ()),
    "mixtral": (dict(sliding_window=WINDOW), ("sliding_window",)),
    # Sliding then global layers; linear rope scaling on the global one; logits soft-capped.
    "gemma3": (
        dict(
            final_logit_softcapping=20.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
        ("final_logit_softcapping", "rope_parameters"),
    ),
    "phi3": (dict(partial_rotary_factor=0.5, sliding_window=WINDOW), ("sliding_window", "partial_rotary_factor")),
}
FAMILIES = list(CASES)
MOE = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("jax-families")
    out = {}
    for family, (config, _) in CASES.items():
        out[family] = make_model(root / family, family, seed=3, **config)
        sharpen(out[family])
    return out


@pytest.fixture(scope="module")
def exported(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    return exports(models, tmp_path_factory.mktemp("jax-families-orbax"))


@pytest.fixture(scope="module")
def references(models: dict[str, Path]) -> Iterator[Callable[[str], TransformersRuntime]]:
    with opened_references(models) as get:
        yield get


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_and_greedy_agree_with_transformers(
    family: str,
    models: dict[str, Path],
    exported: Callable[[str, str], Path],
    references: Callable[[str], TransformersRuntime],
    tmp_path: Path,
) -> None:
    reference = references(family)
    want = reference.logits(IDS)
    rt = JaxRuntime(exported(family, "bf16"))
    try:
        got = rt.logits(IDS)
        m = compare(want[:-1], got[:-1], IDS[1:])
        print(f"\norbax bf16 {family} (float32 compute) vs transformers: {m.model_dump_json()}")
        assert got.shape == want.shape and m.kl <= 1e-6 and m.top1 >= 0.99
        assert np.abs(got - want).max() < 1e-3
        prompts = [IDS[:12], IDS[20:27]]
        assert rt.greedy(prompts, 8) == reference.greedy(prompts, 8)
    finally:
        rt.close()
    # The model is confident, so agreement is not luck...
    assert entropy(want) < 0.5 * np.log(want.shape[1])
    # ...and the family's feature is live: without it transformers computes something else.
    _, features = CASES[family]
    if features:
        plain = tmp_path / "plain"
        shutil.copytree(models[family], plain)
        config = json.loads((plain / "config.json").read_text())
        for key in features:
            config.pop(key)
        (plain / "config.json").write_text(json.dumps(config))
        without = TransformersRuntime(plain)
        try:
            assert compare(want[:-1], without.logits(IDS)[:-1], IDS[1:]).kl > 1e-3
        finally:
            without.close()


@pytest.mark.parametrize("family", MOE)
def test_tokens_route_to_different_experts(family: str, models: dict[str, Path]) -> None:
    """In transformers, the models' routers send the tokens to every expert, in many different pairs, so the logits
    the JAX forward agrees on above depend on which experts each token chose."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(models[family]), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model(torch.tensor([IDS]), output_router_logits=True)
    shape = open_source(models[family]).shape
    assert shape.moe is not None
    k, experts = shape.moe.experts_per_token, shape.moe.experts
    for layer_logits in out.router_logits:
        chosen = torch.topk(layer_logits.float().softmax(-1), k, dim=-1).indices
        per_expert = torch.bincount(chosen.flatten(), minlength=experts)
        assert int((per_expert > 0).sum()) == experts, per_expert  # every expert gets tokens
        assert int(per_expert.max()) < len(IDS), per_expert  # no expert gets them all
        assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 3  # tokens pick different pairs


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3"])
def test_stacked_experts_and_split_linears_hold_the_source_weights(
    family: str, models: dict[str, Path], exported: Callable[[str, str], Path]
) -> None:
    """bf16: each stacked expert row and each split part is the source tensor's bits; weights.json lists the layout."""
    import torch

    art = exported(family, "bf16")
    source = open_source(models[family])
    weights = json.loads((art / "weights.json").read_text())["tensors"]
    rt = JaxRuntime(art)
    try:
        params = rt.restore(list(weights))
    finally:
        rt.close()

    def bits(name: str) -> np.ndarray:
        return source.tensor(name).view(torch.int16).numpy()

    def stored(name: str) -> np.ndarray:
        return np.asarray(params[name]).view(np.int16)

    if family == "qwen3_moe":
        moe = source.shape.moe
        assert moe is not None
        layer = "model.layers.1.mlp.experts."
        assert weights[layer + "gate_proj.weight"]["shape"] == [moe.experts, moe.intermediate_size, 64]
        assert weights[layer + "down_proj.weight"]["shape"] == [moe.experts, 64, moe.intermediate_size]
        assert not any(".experts.0." in n for n in weights)
        for e in range(moe.experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert np.array_equal(stored(layer + f"{proj}.weight")[e], bits(f"{layer}{e}.{proj}.weight"))
        assert np.array_equal(stored("model.layers.1.mlp.gate.weight"), bits("model.layers.1.mlp.gate.weight"))
    else:
        a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
        assert not any("qkv_proj" in n or "gate_up_proj" in n for n in weights)
        qkv, gate_up = bits(a + "qkv_proj.weight"), bits(m + "gate_up_proj.weight")
        parts = np.concatenate([stored(a + f"{p}_proj.weight") for p in "qkv"])
        assert np.array_equal(parts, qkv) and stored(a + "k_proj.weight").shape == (32, 64)
        assert np.array_equal(np.concatenate([stored(m + "gate_proj.weight"), stored(m + "up_proj.weight")]), gate_up)


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3"])
def test_int8_stacks_and_splits_the_quantize_stages_values(
    family: str,
    models: dict[str, Path],
    exported: Callable[[str, str], Path],
    references: Callable[[str], TransformersRuntime],
    tmp_path: Path,
) -> None:
    """int8-w8a16 on stacked experts ([experts, out, in] int8, [experts, out] scales) and split fused Linears
    computes exactly the quantize stage's model (transformers on its dequantized weights), near the bf16 one."""
    art = exported(family, INT8)
    weights = json.loads((art / "weights.json").read_text())["tensors"]
    if family == "qwen3_moe":
        w = weights["model.layers.0.mlp.experts.up_proj.weight"]
        s = weights["model.layers.0.mlp.experts.up_proj.weight_scale"]
        assert w["dtype"] == "int8" and s == {"dtype": "float32", "shape": w["shape"][:2]}
        assert weights["model.layers.0.mlp.gate.weight"]["dtype"] == "bfloat16"  # the router stays bf16
    else:
        assert weights["model.layers.0.self_attn.v_proj.weight_scale"] == {"dtype": "float32", "shape": [32]}
    rt = JaxRuntime(art)
    try:
        got = rt.logits(IDS)
    finally:
        rt.close()
    dequantized = dequantized_model(models[family], art.parent / f"{art.name}-quantize", tmp_path / "dq")
    exact = TransformersRuntime(dequantized)
    try:
        m = compare(exact.logits(IDS)[:-1], got[:-1], IDS[1:])
    finally:
        exact.close()
    vs_bf16 = compare(references(family).logits(IDS)[:-1], got[:-1], IDS[1:])
    print(f"\norbax {INT8} {family}: vs its dequantized model {m.kl:.2e}, vs bf16 transformers {vs_bf16.kl:.2e}")
    assert m.kl <= 1e-6 and m.top1 >= 0.99
    # Near the bf16 model; the sharpened head and router amplify int8's rounding (a token's second expert flips).
    assert 0 < vs_bf16.kl <= 0.05


def _shape(model_dir: Path, **changes: Any) -> ModelShape:
    config = json.loads((model_dir / "config.json").read_text())
    return ModelShape.from_config({**config, **changes})


def test_experts_split_over_the_mesh_by_expert_or_within_each(models: dict[str, Path]) -> None:
    """Expert parallelism where the experts divide the tensor axis; else each expert split as a dense MLP is."""
    shape = _shape(models["qwen3_moe"])
    heads = HeadLayout(shape.num_heads, shape.num_kv_heads, shape.head_dim)
    tensors = checkpoint_tensors(plan_checkpoint(shape, QUANTS[INT8], lambda name: True))
    x = "model.layers.0.mlp.experts."
    specs, notes = plan_sharding(tensors, heads, Mesh.parse({"data": 2, "model": 4}))
    for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        assert specs[x + name] == ("model", None, None), name
    assert specs[x + "down_proj.weight_scale"] == ("model", None)
    assert "expert parallel: 8 experts, 2 whole experts per device" in notes[x + "gate_proj.weight"]
    assert specs["model.layers.0.mlp.gate.weight"] == (None, None)  # the router is replicated

    six = _shape(models["qwen3_moe"], num_experts=6, num_local_experts=6)
    tensors = checkpoint_tensors(plan_checkpoint(six, QUANTS[INT8], lambda name: True))
    specs, notes = plan_sharding(tensors, heads, Mesh.parse({"model": 4}))
    assert specs[x + "gate_proj.weight"] == specs[x + "up_proj.weight"] == (None, "model", None)
    assert specs[x + "gate_proj.weight_scale"] == (None, "model")
    assert specs[x + "down_proj.weight"] == (None, None, "model")
    assert specs[x + "down_proj.weight_scale"] == (None, None)  # one per output channel: row-parallel keeps them
    assert "6 experts do not divide 4" in notes[x + "down_proj.weight"]


MESH_CHECK = """
import json, sys
import numpy as np
from kiln.eval.runtimes import JaxRuntime

art, ids = sys.argv[1], list(range(3, 500, 7))
rt = JaxRuntime(art, mesh=True, resident_bytes=0)
plan = json.load(open(art + "/sharding.json"))
name = "model.layers.1.mlp.experts.gate_proj.weight"
arr = rt.restore([name])[name]
expected = np.load(art + "-expected.npz")
print(json.dumps({
    "spec": list(arr.sharding.spec), "shard": list(arr.addressable_shards[0].data.shape),
    "max_abs": float(np.abs(rt.logits(ids) - expected["logits"]).max()),
}))
"""


def test_expert_parallel_artifact_computes_the_same_on_an_8_device_mesh(exported: Callable[[str, str], Path]) -> None:
    """A fresh process with 8 CPU devices restores the int8 Qwen3-MoE artifact with its experts split over the
    mesh's model axis (2 of 8 per device, scales alike) and computes the single device's logits."""
    art = exported("qwen3_moe", INT8)
    rt = JaxRuntime(art)
    np.savez(f"{art}-expected.npz", logits=rt.logits(IDS))
    rt.close()
    r = on_an_8_device_mesh(MESH_CHECK, str(art))
    assert r["spec"][0] == "model" and r["shard"] == [2, 64, 64], r
    assert r["max_abs"] < 1e-3, r


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 10000.0,
                }
            },
            "'llama3'",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ],
)
def test_kiln_plan_refuses_what_the_forward_does_not_compute(
    changes: dict[str, Any], named: str, models: dict[str, Path], tmp_path: Path
) -> None:
    """A rope scaling the forward does not implement is refused when the recipe is planned, with the reason."""
    from kiln.pipeline.build import plan
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store

    model = tmp_path / "model"
    shutil.copytree(models["qwen3"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    (tmp_path / "heldout.txt").write_text("hello world " * 200)
    recipe = tmp_path / "kiln.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": "m",
                "version": "1.0.0",
                "source": str(model),
                "eval": {"text": "heldout.txt"},
                "targets": [{"target": "orbax", "quants": ["bf16"]}],
            }
        )
    )
    with pytest.raises(InvalidInput) as e:
        plan(load_recipe(recipe, allowed_roots=[tmp_path]), open_store(None, tmp_path / "work"))
    assert e.value.code == "ORBAX_UNSUPPORTED" and named in e.value.message, e.value.message


def test_the_jax_eval_is_planned_with_every_expert_of_a_layer() -> None:
    """Sizing (`pipeline.requirements.jax_forward`) at Qwen3-30B-A3B's shape: a layer is restored with all its
    experts and their router (in bf16, then cast to float32 as used) and the mixture runs every expert on the
    window's tokens, so 128 experts plan that much more than 8 of the same size and top-k, to the byte."""
    from kiln.pipeline.requirements import Sizing, eval_requirements

    window, memory = 128, {}
    for experts in (8, 128):
        config = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151_936,
            "moe_intermediate_size": 768,
            "num_experts": experts,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
        }
        shape = ModelShape.from_config(config)
        sizing = Sizing.of_config(config, shape, max_tokens=512, window=window, greedy_tokens=8)
        memory[experts] = eval_requirements(sizing, "jax", "bf16").memory_bytes
    h, f, extra = 2048, 768, 128 - 8
    restored = (2 + 4) * extra * (3 * f * h + h)  # the experts and their router rows: bf16 restored, float32 used
    dense = 4 * window * extra * (3 * f + h)  # gate, up, their product and each expert's output, float32
    assert memory[128] - memory[8] == restored + dense
    assert restored > 2 * 10**9  # over 2 GB more: a 128-expert layer is 1.2 GB in bf16


@pytest.mark.parametrize("quant", ["bf16", "int8-w8a16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_checkpoint_passes_the_lint(
    family: str, quant: str, exported: Callable[[str, str], Path], models: dict[str, Path]
) -> None:
    """What the orbax export writes, the lint (which the export stage runs) passes: one plan for writer and lint."""
    from kiln.targets.lint import lint_artifact

    report = lint_artifact(exported(family, quant), shape=open_source(models[family]).shape, quant=quant)
    assert report.errors == [], [(f.code, f.subject, f.message) for f in report.errors]
