"""The orbax target and its JAX forward on DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing
with a correction bias, shared experts, YaRN with its attention scale) and gpt-oss (sinks, alternating sliding and
full layers, YaRN without truncation, a biased router with a softmax after the top-k, stacked interleaved experts with
biases and a clamped SwiGLU): tiny random models made by transformers' own classes, sharpened, exported in bf16 and
int8-w8a16, restored by the JAX runtime and compared with transformers on 71 tokens (longer than gpt-oss's 16-token
window) by KL and by greedy continuations decoded on the runtime's KV cache, with each feature shown to change what
transformers computes; the layout (gpt-oss's experts de-interleaved and transposed, bit for bit) and the sharding
plan (experts stacked and expert-parallel, MLA's per-head tensors split by heads, its latents replicated)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.eval.metrics import compare
from kiln.eval.runtimes import JaxRuntime, TransformersRuntime
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.hf_model import open_source
from kiln.targets.orbax.layout import INT8, QUANTS, checkpoint_tensors, plan_checkpoint
from kiln.targets.orbax.sharding import HeadLayout, Mesh, plan_sharding
from tests.eval.orbax_models import dequantized_model, entropy, exports, on_an_8_device_mesh
from tests.eval.orbax_models import references as opened_references
from tests.model_factory import make_model, sharpen

IDS = list(range(3, 500, 7))  # 71 tokens, past gpt-oss's 16-token window
# DeepSeek-V3's own rope (its config.json's `rope_scaling`), with a pretraining length the window passes.
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
# Per model: its family, config beyond model_factory's, and what must change transformers' logits when undone (a
# config change, or tensors rewritten by `_edit`), so that agreeing with transformers tests each feature.
CASES: dict[str, tuple[str, dict[str, Any], dict[str, dict[str, Any]]]] = {
    "deepseek_v3": (
        "deepseek_v3",
        {"rope_parameters": DEEPSEEK_YARN, "n_group": 4, "topk_group": 2},
        {
            "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            "rope_interleave": {"rope_interleave": False},
            "correction_bias": {"tensors": "e_score_correction_bias"},
        },
    ),
    # The query without its latent (one q_proj), the rope on halves, biases on kv_a and o.
    "deepseek_v3_q_proj": ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True}, {}),
    # YaRN is no family's own: a grouped-query model with q/k norms scales its rope the same way.
    "qwen3_yarn": (
        "qwen3",
        {"rope_parameters": {**DEEPSEEK_YARN, "factor": 4.0, "mscale": None, "mscale_all_dim": None}},
        {"yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    "gpt_oss": (
        "gpt_oss",
        {},
        {
            "window": {"layer_types": ["full_attention", "full_attention"]},
            "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
            "sinks": {"tensors": "sinks"},
        },
    ),
}
MODELS = list(CASES)


def _edit(model_dir: Path, suffix: str, value: Callable[[Any], Any]) -> None:
    """Rewrite every tensor whose name ends with `suffix` to `value(tensor)` (bf16)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith(suffix):
            tensors[name] = value(t.float()).to(torch.bfloat16).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model, sharpened (q_b and kv_a too: MLA's query and rope key), with live sinks and correction biases."""
    import torch

    root = tmp_path_factory.mktemp("jax-frontier")
    out = {}
    g = torch.Generator().manual_seed(7)
    for name, (family, config, _) in CASES.items():
        out[name] = make_model(root / name, family, seed=5, **config)
        sharpen(out[name])
        _edit(out[name], ".self_attn.sinks", lambda t: torch.randn(t.shape, generator=g) * 2.0)
        _edit(out[name], ".e_score_correction_bias", lambda t: torch.rand(t.shape, generator=g) * 0.6 - 0.3)
    return out


@pytest.fixture(scope="module")
def exported(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    return exports(models, tmp_path_factory.mktemp("jax-frontier-orbax"))


@pytest.fixture(scope="module")
def references(models: dict[str, Path]) -> Iterator[Callable[[str], TransformersRuntime]]:
    with opened_references(models) as get:
        yield get


def _variant(model_dir: Path, out: Path, change: dict[str, Any]) -> np.ndarray:
    """transformers' logits of the model with `change` made: config keys set, or `tensors` neutralised (sinks to
    -30, so no row's probability goes to them; correction biases to 0)."""
    shutil.copytree(model_dir, out)
    change = dict(change)
    tensors = change.pop("tensors", None)
    if tensors == "sinks":
        _edit(out, ".self_attn.sinks", lambda t: t * 0 - 30.0)
    elif tensors is not None:
        _edit(out, "." + tensors, lambda t: t * 0)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **change}))
    rt = TransformersRuntime(out)
    try:
        return rt.logits(IDS)
    finally:
        rt.close()


@pytest.mark.parametrize("name", MODELS)
def test_bf16_logits_and_greedy_agree_with_transformers(
    name: str,
    models: dict[str, Path],
    exported: Callable[[str, str], Path],
    references: Callable[[str], TransformersRuntime],
    tmp_path: Path,
) -> None:
    reference = references(name)
    want = reference.logits(IDS)
    rt = JaxRuntime(exported(name, "bf16"))
    try:
        got = rt.logits(IDS)
        m = compare(want[:-1], got[:-1], IDS[1:])
        print(f"\norbax bf16 {name} (float32 compute) vs transformers: {m.model_dump_json()}")
        assert got.shape == want.shape and m.kl <= 1e-6 and m.top1 >= 0.99
        # Prompts past the window, so decoding on the cache slides it too.
        prompts = [IDS[:24], IDS[30:37]]
        assert rt.greedy(prompts, 8) == reference.greedy(prompts, 8)
    finally:
        rt.close()
    assert entropy(want) < 0.5 * np.log(want.shape[1])  # confident: agreement is not luck
    for feature, change in CASES[name][2].items():
        without = _variant(models[name], tmp_path / feature, change)
        kl = compare(want[:-1], without[:-1], IDS[1:]).kl
        assert kl > 1e-3, (feature, kl)


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_int8_computes_the_quantize_stages_model(
    name: str,
    models: dict[str, Path],
    exported: Callable[[str, str], Path],
    references: Callable[[str], TransformersRuntime],
    tmp_path: Path,
) -> None:
    """int8-w8a16: MLA's five Linears, the dense MLP and every expert of DeepSeek-V3 (stacked, [experts, out]
    scales) as int8, gpt-oss's attention (its stacked experts are no Linear a scheme writes: bf16), computing exactly
    the quantize stage's model (transformers on its dequantized weights)."""
    art = exported(name, INT8)
    weights = json.loads((art / "weights.json").read_text())["tensors"]
    if name == "deepseek_v3":
        a, x = "model.layers.1.self_attn.", "model.layers.1.mlp.experts."
        for linear in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert weights[a + linear + ".weight"]["dtype"] == "int8", linear
        assert weights[x + "gate_proj.weight_scale"] == {"dtype": "float32", "shape": [8, 32]}
        assert weights["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "bfloat16"
    else:
        assert weights["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "int8"
        assert weights["model.layers.0.mlp.experts.gate_proj.weight"]["dtype"] == "bfloat16"
    rt = JaxRuntime(art)
    try:
        got = rt.logits(IDS)
    finally:
        rt.close()
    dequantized = dequantized_model(models[name], art.parent / f"{art.name}-quantize", tmp_path / "dq")
    exact = TransformersRuntime(dequantized)
    try:
        m = compare(exact.logits(IDS)[:-1], got[:-1], IDS[1:])
    finally:
        exact.close()
    vs_bf16 = compare(references(name).logits(IDS)[:-1], got[:-1], IDS[1:])
    print(f"\norbax {INT8} {name}: vs its dequantized model {m.kl:.2e}, vs bf16 transformers {vs_bf16.kl:.2e}")
    assert m.kl <= 1e-6 and m.top1 >= 0.99
    assert vs_bf16.kl > 0


def test_gpt_oss_experts_are_stored_de_interleaved_and_transposed(
    models: dict[str, Path], exported: Callable[[str, str], Path]
) -> None:
    """gate_up_proj [experts, hidden, 2 x intermediate] (gate the even columns) becomes gate_proj and up_proj
    [experts, intermediate, hidden], down_proj [experts, intermediate, hidden] becomes [experts, hidden,
    intermediate], their biases split alike: the source's bits, rearranged."""
    import torch

    art = exported("gpt_oss", "bf16")
    source = open_source(models["gpt_oss"])
    weights = json.loads((art / "weights.json").read_text())["tensors"]
    rt = JaxRuntime(art)
    try:
        params = rt.restore(list(weights))
    finally:
        rt.close()
    x = "model.layers.1.mlp.experts."

    def bits(name: str) -> np.ndarray:
        return source.tensor(x + name).view(torch.int16).numpy()

    def stored(name: str) -> np.ndarray:
        return np.asarray(params[x + name]).view(np.int16)

    assert not any(n.endswith(("gate_up_proj", "gate_up_proj_bias", "experts.down_proj")) for n in weights)
    gate_up, bias = bits("gate_up_proj"), bits("gate_up_proj_bias")
    assert np.array_equal(stored("gate_proj.weight"), gate_up[..., 0::2].transpose(0, 2, 1))
    assert np.array_equal(stored("up_proj.weight"), gate_up[..., 1::2].transpose(0, 2, 1))
    assert np.array_equal(stored("gate_proj.bias"), bias[..., 0::2])
    assert np.array_equal(stored("up_proj.bias"), bias[..., 1::2])
    assert np.array_equal(stored("down_proj.weight"), bits("down_proj").transpose(0, 2, 1))
    assert np.array_equal(stored("down_proj.bias"), bits("down_proj_bias"))
    assert weights[x + "gate_proj.weight"]["shape"] == [4, 256, 64]  # [experts, intermediate, hidden]


def _specs(model_dir: Path, mesh: dict[str, int]) -> tuple[dict[str, Any], dict[str, str]]:
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    tensors = checkpoint_tensors(plan_checkpoint(shape, QUANTS[INT8], lambda name: True))
    return plan_sharding(tensors, HeadLayout(shape.num_heads, shape.num_kv_heads, shape.head_dim), Mesh.parse(mesh))


def test_the_sharding_plan_splits_experts_heads_and_sinks_and_replicates_latents(models: dict[str, Path]) -> None:
    specs, notes = _specs(models["deepseek_v3"], {"data": 2, "model": 4})
    a, x = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert specs[x + "experts.gate_proj.weight"] == ("model", None, None)  # 8 experts: 2 per device
    assert specs[x + "experts.down_proj.weight_scale"] == ("model", None)
    assert "expert parallel" in notes[x + "experts.up_proj.weight"]
    assert specs[x + "gate.weight"] == specs[x + "gate.e_score_correction_bias"][:1] + (None,) == (None, None)
    assert specs[x + "shared_experts.gate_proj.weight"] == ("model", None)
    assert specs[x + "shared_experts.down_proj.weight"] == (None, "model")
    assert specs[a + "q_b_proj.weight"] == specs[a + "kv_b_proj.weight"] == ("model", None)  # by whole heads
    assert specs[a + "o_proj.weight"] == (None, "model")
    for latent in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_proj.weight_scale"):
        assert specs[a + latent] == (None, None)[: len(specs[a + latent])], latent
        assert "a latent every head reads" in notes[a + latent]
    assert specs[a + "kv_a_layernorm.weight"] == (None,)

    specs, notes = _specs(models["gpt_oss"], {"model": 4})
    a, x = "model.layers.0.self_attn.", "model.layers.0.mlp.experts."
    assert specs[a + "sinks"] == ("model",)  # with their heads
    assert specs[a + "q_proj.bias"] == ("model",) and specs[a + "o_proj.bias"] == (None,)
    for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_proj.bias", "down_proj.bias"):
        assert specs[x + name][0] == "model", name  # 4 experts: one per device
    assert specs["model.layers.0.mlp.router.bias"] == (None,)


def test_the_jax_eval_of_mla_is_planned_with_every_heads_keys_and_values() -> None:
    """Sizing (`pipeline.requirements.jax_forward`) at DeepSeek-V3's shape: a wider value head costs its kv_b and o
    rows (restored in bf16, used in float32) and the expanded values of the context, [context, heads, v], to the
    byte; the latent cache does not grow."""
    from kiln.pipeline.requirements import Sizing, eval_requirements
    from tests.pipeline.test_frontier_plans import config_of

    memory, context = {}, 0
    for v in (128, 256):
        config = {**config_of("deepseek-v3"), "v_head_dim": v}
        shape = ModelShape.from_config(config)
        sizing = Sizing.of_config(config, shape, max_tokens=512, window=128, greedy_tokens=8)
        memory[v], context = eval_requirements(sizing, "jax", "bf16").memory_bytes, sizing.context
    heads, rank, hidden, extra = 128, 512, 7168, 128
    restored = (2 + 4) * heads * extra * (rank + hidden)  # kv_b_proj's and o_proj's rows
    assert memory[256] - memory[128] == restored + 4 * context * heads * extra


@pytest.mark.parametrize(
    ("name", "rope"),
    [
        ("deepseek_v3", {"type": "dynamic", "factor": 2.0}),
        ("gpt_oss", {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
    ],
)
def test_what_the_forward_does_not_compute_is_refused_at_plan_time(
    name: str, rope: dict[str, Any], models: dict[str, Path]
) -> None:
    """The target's model check (`kiln plan`): ORBAX_UNSUPPORTED with the reason, before anything is built."""
    from kiln.core.errors import InvalidInput
    from kiln.targets.orbax.layout import check_model

    config = {**json.loads((models[name] / "config.json").read_text()), "rope_scaling": rope}
    with pytest.raises(InvalidInput) as e:
        check_model(ModelShape.from_config(config), config, "bf16", {})
    assert (
        e.value.code == "ORBAX_UNSUPPORTED" and "is not implemented (known: default, linear, yarn)" in e.value.message
    )


MESH_CHECK = """
import json, sys
import numpy as np
from kiln.eval.runtimes import JaxRuntime

out = {}
for art in sys.argv[1:]:
    rt = JaxRuntime(art, mesh=True, resident_bytes=0)
    out[art] = float(np.abs(rt.logits(list(range(3, 500, 7))) - np.load(art + "-expected.npy")).max())
print(json.dumps(out))
"""


def test_both_compute_the_same_on_an_8_device_mesh(exported: Callable[[str, str], Path]) -> None:
    """A fresh process with 8 CPU devices restores DeepSeek-V3 (MLA split by heads, latents replicated, experts
    expert-parallel) and gpt-oss (sinks with their heads) onto the 2 x 4 mesh and computes the single device's
    logits."""
    arts = [exported(name, "bf16") for name in ("deepseek_v3", "gpt_oss")]
    for art in arts:
        rt = JaxRuntime(art)
        np.save(f"{art}-expected.npy", rt.logits(IDS))
        rt.close()
    diffs = on_an_8_device_mesh(MESH_CHECK, *map(str, arts))
    assert all(d < 1e-3 for d in diffs.values()), diffs
