"""The architecture records (`formats.architectures`): each family's model, made by transformers' own classes,
ingests with exactly the tensors the record implies; each family's config is checked with exact types and
bounds; the Linear weights a scheme may quantize are the ones transformers computes with as Linears; a target a
record refuses is refused at plan time with the record's reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.core.errors import InvalidInput, SourceInvalid
from kiln.core.shape import ShapeRecord
from kiln.formats.architectures import ARCHITECTURES, FAMILIES, LINEAR_WEIGHT, get_architecture
from kiln.formats.architectures.record import EXPERT_KINDS, TensorKind
from kiln.formats.architectures.shape import ModelShape
from kiln.formats.hf_model import open_source
from kiln.targets.base import all_targets
from tests.model_factory import FAMILIES as FACTORY_FAMILIES
from tests.model_factory import FAMILY_CONFIG, make_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_model(root / f, f, vocab_size=384) for f in FACTORY_FAMILIES}


def test_every_family_has_one_record_and_the_factory_makes_each() -> None:
    assert set(FAMILIES) == set(FACTORY_FAMILIES)
    for family, hf_class in FACTORY_FAMILIES.items():
        assert ARCHITECTURES[hf_class].family == family
        assert FAMILIES[family].hf_class == hf_class


@pytest.mark.parametrize("family", list(FACTORY_FAMILIES))
def test_a_transformers_model_ingests_with_exactly_the_tensors_its_record_implies(
    models: dict[str, Path], family: str
) -> None:
    from safetensors import safe_open

    source = open_source(models[family])
    with safe_open(str(models[family] / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert source.shape.expected_tensors() == saved
    assert source.shape.tensor_count == len(saved)
    assert list(source.tensors) == [t.name for t in source.shape.tensors()]


@pytest.mark.parametrize("family", list(FACTORY_FAMILIES))
def test_the_linear_weights_are_what_transformers_computes_as_linears(models: dict[str, Path], family: str) -> None:
    """Every 2-D weight a scheme may quantize is a Linear's (or one expert's slice of a fused experts tensor) in
    transformers' own model; routers, norms, embeddings and the head never are."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(models[family]))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    shape = open_source(models[family]).shape
    quantizable = {t.name for t in shape.tensors() if t.quantizable}
    assert quantizable == {n for n in shape.expected_tensors() if LINEAR_WEIGHT.match(n)}
    experts = {t.name for t in shape.tensors() if t.kind in EXPERT_KINDS}
    assert quantizable - experts == linears - {"lm_head.weight"} - _routers(shape)
    assert bool(experts) == (shape.moe is not None)


def _routers(shape: ModelShape) -> set[str]:
    return {t.name for t in shape.tensors() if t.kind == TensorKind.FFN_GATE_INP}


def test_the_moe_shapes_are_read_as_transformers_builds_them(tmp_path: Path) -> None:
    src = make_model(
        tmp_path / "m",
        "qwen3_moe",
        num_layers=4,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        vocab_size=384,
    )
    shape = open_source(src).shape
    assert shape.moe is not None and shape.moe.sparse_layers == (1, 2, 3)
    assert not shape.is_sparse(0) and "model.layers.0.mlp.gate_proj.weight" in shape.expected_tensors()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in shape.expected_tensors()
    record = shape.record()
    assert (record.num_experts, record.experts_per_token, record.moe_intermediate_size, record.sparse_layers) == (
        8,
        2,
        64,
        3,
    )
    assert ShapeRecord.model_validate_json(record.model_dump_json()) == record


def test_a_dense_record_writes_what_stored_releases_hold(models: dict[str, Path]) -> None:
    """A dense model's record JSON has no expert or window keys: stage records and releases keep their digests."""
    dumped = open_source(models["llama"]).shape.record().model_dump(mode="json")
    assert "num_experts" not in dumped and "sliding_window" not in dumped


def test_gemma3_layers_windows_and_ropes(models: dict[str, Path]) -> None:
    shape = open_source(models["gemma3"]).shape
    assert shape.layer_types == ("sliding_attention", "full_attention")
    assert shape.sliding_window == 16 and shape.tie_word_embeddings
    assert shape.rope_for("full_attention").theta == 1_000_000.0
    assert shape.rope_for("sliding_attention").theta == 10_000.0
    assert shape.hidden_act == "gelu_pytorch_tanh" and shape.query_pre_attn_scalar == 16
    assert shape.record().sliding_layers == 1


def test_a_hub_style_gemma3_config_reads_its_pattern_and_local_rope() -> None:
    """Configs on the Hub predate `layer_types` and `rope_parameters`: `sliding_window_pattern`, `rope_theta`,
    `rope_local_base_freq` and a linear `rope_scaling` for the global layers."""
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 262208,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
    }
    shape = ModelShape.from_config(config)
    assert shape.layer_types.count("full_attention") == 5 and shape.layer_type(5) == "full_attention"
    full, local = shape.rope_for("full_attention"), shape.rope_for("sliding_attention")
    assert (full.theta, full.scaling, full.factor) == (1e6, "linear", 8.0)
    assert (local.theta, local.scaling, local.factor) == (1e4, "default", None)
    # The registry reads an untrusted config without the family's defaults; what sizes the KV cache agrees.
    kv = ("num_layers", "num_kv_heads", "head_dim", "sliding_window", "sliding_layers")
    untrusted, record = ShapeRecord.from_untrusted(config), shape.record()
    assert isinstance(untrusted, ShapeRecord)
    assert {k: getattr(untrusted, k) for k in kv} == {k: getattr(record, k) for k in kv}


def _base(family: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [FACTORY_FAMILIES[family]],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    if family == "qwen3_moe":
        config |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    if family == "mixtral":
        config |= {"num_local_experts": 4, "num_experts_per_tok": 2}
    if family == "deepseek_v3":
        config |= {"num_key_value_heads": 4, "head_dim": None, **FAMILY_CONFIG["deepseek_v3"]}
    if family == "gpt_oss":
        config |= {"num_local_experts": 4, "num_experts_per_tok": 2}
    return config


@pytest.mark.parametrize(
    ("family", "change", "field", "says"),
    [
        ("qwen3_moe", {"num_experts": None, "num_local_experts": None}, "config", "num_experts"),
        ("qwen3_moe", {"num_local_experts": 16}, "config", "disagree"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "config", "exceeds"),
        ("qwen3_moe", {"num_experts": "8"}, "num_experts", "valid integer"),
        ("qwen3_moe", {"num_experts": 8.0}, "num_experts", "valid integer"),
        ("qwen3_moe", {"num_experts": 10**9}, "num_experts", "less than or equal"),
        ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size", "greater than 0"),
        ("qwen3_moe", {"mlp_only_layers": [2]}, "config", "distinct layers"),
        ("qwen3_moe", {"norm_topk_prob": "true"}, "norm_topk_prob", "valid boolean"),
        ("mixtral", {"num_local_experts": None}, "num_local_experts", "is required"),
        ("mixtral", {"num_experts_per_tok": 5}, "config", "exceeds"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention", "encoder"),
        ("gemma3", {"hidden_activation": "silu"}, "hidden_activation", "gelu_pytorch_tanh"),
        ("gemma3", {"layer_types": ["full_attention"]}, "config", "layer_types has 1 entries"),
        ("gemma3", {"layer_types": ["sliding_attention", "chunked"]}, "layer_types", "one of"),
        ("gemma3", {"query_pre_attn_scalar": float("nan")}, "query_pre_attn_scalar", "finite"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act", "silu"),
        ("qwen3", {"rope_parameters": {"full_attention": 3}}, "rope_parameters", "object"),
        ("qwen3", {"rope_parameters": {"rope_theta": "1e6"}}, "rope_parameters.rope_theta", "valid number"),
        ("phi3", {"partial_rotary_factor": 1.5}, "partial_rotary_factor", "less than or equal"),
        ("deepseek_v3", {"num_key_value_heads": 2}, "config", "MLA expands its latent to every head"),
        ("deepseek_v3", {"head_dim": 16}, "config", "qk_rope_head_dim=8"),
        ("deepseek_v3", {"qk_head_dim": 16}, "config", "qk_nope_head_dim + qk_rope_head_dim = 24"),
        ("deepseek_v3", {"n_group": 3}, "config", "groups of at least 2"),
        ("deepseek_v3", {"topk_group": 3}, "config", "exceeds n_group=2"),
        ("deepseek_v3", {"num_experts_per_tok": 5}, "config", "exceeds the 4 experts"),
        ("deepseek_v3", {"first_k_dense_replace": 3}, "config", "exceeds num_hidden_layers"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func", "sigmoid"),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq", "1"),
        ("deepseek_v3", {"num_mtp_layers": 2, "num_nextn_predict_layers": 1}, "config", "disagree"),
        ("deepseek_v3", {"kv_lora_rank": 0}, "kv_lora_rank", "greater than 0"),
        ("gpt_oss", {"swiglu_limit": 5.0}, "config", "clamps at 7.0"),
        ("gpt_oss", {"num_experts": 8}, "config", "disagree"),
        ("gpt_oss", {"num_experts_per_tok": 5}, "config", "exceeds"),
        ("gpt_oss", {"layer_types": ["sliding_attention"]}, "config", "layer_types has 1 entries"),
    ],
)
def test_a_bad_family_config_is_refused_naming_the_field(
    family: str, change: dict[str, Any], field: str, says: str
) -> None:
    config = {k: v for k, v in {**_base(family), **change}.items() if v is not None}
    with pytest.raises(SourceInvalid) as e:
        ModelShape.from_config(config)
    assert e.value.code == "SOURCE_INVALID"
    assert e.value.details["field"] == field and says in e.value.message, e.value.message


@pytest.mark.parametrize(
    ("quantization_config", "field", "says"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size", "at least 2"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt", "'e4m3'"),
        ({"quant_method": "mxfp4", "group_size": 16}, "quantization_config.group_size", "not a key"),
        ("fp8", "quantization_config", "must be an object"),
    ],
)
def test_a_bad_quantization_config_is_refused_by_the_one_reader_of_it(
    quantization_config: Any, field: str, says: str
) -> None:
    """A family's schema reads `quantization_config` through `formats.prequantized`, so a release's config and
    its headers are held to the same layout, with that module's code and messages."""
    with pytest.raises(SourceInvalid) as e:
        ModelShape.from_config({**_base("deepseek_v3"), "quantization_config": quantization_config})
    assert e.value.code == "SOURCE_QUANTIZATION_INVALID"
    assert e.value.details["field"] == field and says in e.value.message, e.value.message


def test_a_quantization_config_is_read_as_transformers_reads_it() -> None:
    """FP8 without `weight_block_size` is FineGrainedFP8Config's 128 x 128 blocks; a method that is no release
    layout (kiln's own compressed-tensors bundles) leaves the stored tensors to the headers."""
    base = _base("deepseek_v3")
    fp8 = ModelShape.from_config({**base, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}})
    assert fp8.source_quant is not None and fp8.source_quant.block == (128, 128)
    bundle = ModelShape.from_config({**base, "quantization_config": {"quant_method": "compressed-tensors"}})
    assert bundle.source_quant is None


def test_a_shape_its_layout_cannot_store_is_refused_as_its_sizes_are_read() -> None:
    """MXFP4 blocks 32 inputs: experts of 48 are no whole number of blocks, which the layout's own rules find."""
    oss = ModelShape.from_config(
        {**_base("gpt_oss"), "intermediate_size": 48, "quantization_config": {"quant_method": "mxfp4"}}
    )
    with pytest.raises(SourceInvalid, match=r"mxfp4 cannot store '.*experts.down_proj' \[4, 48, 64\]") as e:
        list(oss.stored_tensors())
    assert e.value.code == "SOURCE_QUANTIZATION_INVALID" and e.value.details["field"] == "quantization_config"


def test_an_unknown_architecture_names_every_supported_one() -> None:
    with pytest.raises(SourceInvalid, match="Glm4MoeForCausalLM.*supported: LlamaForCausalLM") as e:
        get_architecture(["Glm4MoeForCausalLM"])
    assert e.value.details["supported"] == list(ARCHITECTURES)


# The targets and runtimes each record refuses: none (the families of issue 39 map every target: GGUF
# tests/targets/test_gguf_frontier.py, orbax tests/eval/test_jax_frontier.py, trtllm
# tests/targets/test_trtllm_frontier.py, vLLM tests/eval/test_vllm_frontier.py).
REFUSED: dict[str, set[str]] = {}


def test_a_target_a_record_refuses_is_refused_with_its_reason() -> None:
    from dataclasses import replace

    from kiln.formats.architectures.record import refused

    targets = all_targets()
    for arch in ARCHITECTURES.values():
        named = {"vllm", *(n for n, spec in targets.items() if spec.per_architecture)}
        assert {n for n in named if not arch.target(n).supported} == REFUSED.get(arch.family, set()), arch.family
        for name, spec in targets.items():
            mapping = arch.target(name)
            if not spec.per_architecture or mapping.supported:
                spec.check_architecture(arch)
            else:
                with pytest.raises(InvalidInput) as refusal:
                    spec.check_architecture(arch)
                assert refusal.value.details["reason"] == mapping.refused and mapping.refused in refusal.value.message
            if not spec.per_architecture:
                continue
            denied = replace(arch, targets={**arch.targets, name: refused("its runtime lacks the family")})
            with pytest.raises(InvalidInput) as e:
                spec.check_architecture(denied)
            assert e.value.code == "TARGET_ARCHITECTURE_UNSUPPORTED"
            assert e.value.details == {
                "target": name,
                "architecture": arch.hf_class,
                "reason": "its runtime lacks the family",
            }


def test_kiln_plan_refuses_what_a_target_cannot_serve_of_the_model(models: dict[str, Path], tmp_path: Path) -> None:
    """A family every target maps can still have a model or quant one target cannot serve: planned, it is refused
    with the reason before any stage runs (TensorRT-LLM's Phi-3 loader reads no quantized fused projection)."""
    from kiln.pipeline.build import plan
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store

    (tmp_path / "heldout.txt").write_text("hello world " * 200)
    recipe = tmp_path / "kiln.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": "m",
                "version": "1.0.0",
                "source": str(models["phi3"]),
                "eval": {"text": "heldout.txt"},
                "targets": [{"target": "hf-bundle", "quants": ["bf16"]}, {"target": "trtllm", "quants": ["fp8"]}],
            }
        )
    )
    with pytest.raises(InvalidInput) as e:
        plan(load_recipe(recipe, allowed_roots=[models["phi3"].parent]), open_store(None, tmp_path / "work"))
    assert e.value.details["target"] == "trtllm" and e.value.details["quant"] == "fp8"
    assert "Phi3ForCausalLM" in e.value.message and e.value.details["reason"]


def test_deepseek_v3_latent_attention_experts_and_routing_as_transformers_builds_them(models: dict[str, Path]) -> None:
    """transformers' DeepseekV3ForCausalLM, saved: MLA's projections, a dense first layer, then the routed experts
    one by one, the router's correction bias and the shared expert; transformers writes head_dim as the rope's width,
    kiln's head_dim is each query's and key's."""
    shape = open_source(models["deepseek_v3"]).shape
    assert shape.mla is not None and (shape.mla.q_lora_rank, shape.mla.kv_lora_rank, shape.mla.cache_width) == (
        32,
        16,
        24,
    )
    assert (shape.head_dim, shape.num_kv_heads, shape.mla.v_head_dim) == (16 + 8, 4, 16)
    moe = shape.moe
    assert moe is not None and moe.sparse_layers == (1,) and moe.shared_intermediate_size == 32
    assert (moe.groups, moe.topk_groups, moe.routed_scaling_factor, moe.norm_topk_prob) == (2, 1, 2.5, True)
    kinds = {t.name.removeprefix("model.layers.1."): t.kind for t in shape.layer_tensors(1)}
    assert kinds["self_attn.kv_a_proj_with_mqa.weight"] == TensorKind.ATTN_KV_A_MQA
    assert kinds["mlp.gate.e_score_correction_bias"] == TensorKind.FFN_EXP_PROBS_B
    assert kinds["mlp.shared_experts.down_proj.weight"] == TensorKind.FFN_DOWN_SHEXP
    assert "model.layers.0.mlp.gate_proj.weight" in shape.expected_tensors()  # first_k_dense_replace=1
    assert shape.prediction_layers == 1 and shape.source_quant is None  # transformers saves bf16
    record = shape.record()
    assert (record.kv_lora_rank, record.qk_rope_head_dim, record.q_lora_rank, record.v_head_dim) == (16, 8, 32, 16)
    assert ShapeRecord.model_validate_json(record.model_dump_json()) == record


def test_gpt_oss_windows_sinks_and_stacked_experts_as_transformers_builds_them(models: dict[str, Path]) -> None:
    shape = open_source(models["gpt_oss"]).shape
    assert shape.layer_types == ("sliding_attention", "full_attention") and shape.sliding_window == 16
    assert shape.attention_bias and shape.swiglu_limit == 7.0
    full = shape.rope_for("full_attention")
    assert (full.theta, full.scaling, full.factor) == (150_000.0, "yarn", 32.0)
    t = {x.name.removeprefix("model.layers.0."): x for x in shape.layer_tensors(0)}
    assert t["self_attn.sinks"].shape == (4,) and t["self_attn.o_proj.bias"].bias
    assert (t["mlp.experts.gate_up_proj"].shape, t["mlp.experts.down_proj"].shape) == ((4, 64, 512), (4, 256, 64))
    assert t["mlp.router.bias"].kind == TensorKind.FFN_GATE_INP and t["mlp.router.bias"].bias
    assert not t["mlp.experts.gate_up_proj"].quantizable  # a stack of every expert: no scheme writes it yet
    assert shape.record().sliding_layers == 1


def _with_tensors(
    src: Path, out: Path, extra: dict[str, tuple[int, ...]], config: dict[str, Any] | None = None
) -> Path:
    """A copy of the model in `src` whose checkpoint also holds `extra` (zeros of those shapes), and whose config.json
    is updated with `config`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    tensors |= {name: torch.zeros(dims, dtype=torch.bfloat16) for name, dims in extra.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if config:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


def test_a_released_checkpoints_prediction_layer_is_recognised_and_left_in_the_source(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """DeepSeek-V3's release carries its multi-token-prediction layer as `model.layers.<num_hidden_layers>.*`, which
    transformers does not load: ingest accepts it whole (names and shapes checked), builds nothing from it and says
    why; part of it, a wrong shape or a layer past it is refused."""
    base = models["deepseek_v3"]
    extra = {t.name: t.shape for t in open_source(base).shape.extra_tensors()}
    assert "model.layers.2.eh_proj.weight" in extra and extra["model.layers.2.eh_proj.weight"] == (64, 128)
    assert "model.layers.2.shared_head.head.weight" in extra and "model.layers.2.mlp.experts.7.up_proj.weight" in extra
    source = open_source(_with_tensors(base, tmp_path / "release", extra))
    assert list(source.tensors) == [t.name for t in source.shape.tensors()]  # what kiln builds from: unchanged
    assert {name for name, _ in source.unused_tensors} == set(extra)
    assert all("speculative decoding" in reason for _, reason in source.unused_tensors)

    partial = dict(list(extra.items())[:-1])
    with pytest.raises(SourceInvalid, match="multi-token-prediction") as e:
        open_source(_with_tensors(base, tmp_path / "partial", partial))
    assert e.value.details["missing"] == [list(extra)[-1]]
    wrong = {**extra, "model.layers.2.eh_proj.weight": (64, 64)}
    with pytest.raises(SourceInvalid, match="eh_proj"):
        open_source(_with_tensors(base, tmp_path / "wrong", wrong))
    beyond = {**extra, "model.layers.3.enorm.weight": (64,)}
    with pytest.raises(SourceInvalid, match="implies 53 tensors") as e:
        open_source(_with_tensors(base, tmp_path / "beyond", beyond))
    assert (e.value.details["expected_count"], e.value.details["count"]) == (53, 54)
    # A family with no prediction layers recognises none.
    with pytest.raises(SourceInvalid, match="implies"):
        open_source(_with_tensors(models["qwen3_moe"], tmp_path / "qwen", {"model.layers.2.enorm.weight": (64,)}))


def test_the_stored_spellings_of_a_prequantized_release_are_transformers_own() -> None:
    """What config.json's quantization_config says the release stores: DeepSeek-V3's FP8 weights and float32
    `weight_scale_inv` per 128 x 128 block as transformers' FP8Linear holds them (integrations/finegrained_fp8.py);
    gpt-oss's MXFP4 `_blocks` and `_scales`, which transformers' own decoder (integrations/mxfp4.py
    `convert_moe_packed_tensors`) turns into the stacked bf16 experts' shapes."""
    import torch
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kiln.formats.safetensors import DTYPES

    examples = Path(__file__).parents[2] / "examples"
    deepseek = ModelShape.from_config(json.loads((examples / "deepseek-v3" / "config.json").read_text()))
    stored = {s.name: s for s in deepseek.stored_tensors()}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in stored
    assert "model.layers.3.mlp.gate.weight_scale_inv" not in stored  # the router stays bf16
    assert "lm_head.weight_scale_inv" not in stored and stored["lm_head.weight"].dtype is None
    shapes = {t.shape for t in deepseek.layer_tensors(3) if t.quantizable}
    assert len(shapes) == 7  # q_a, q_b, kv_a, kv_b, o; an expert's gate and up, its down
    with torch.device("meta"):
        for rows, cols in shapes:
            linear = FP8Linear(cols, rows, block_size=(128, 128))
            weight, scale = next(
                (stored[t.name], stored[t.name.replace(".weight", ".weight_scale_inv")])
                for t in deepseek.layer_tensors(3)
                if t.shape == (rows, cols) and t.quantizable
            )
            assert (weight.dtype, weight.shape) == ("F8_E4M3", tuple(linear.weight.shape))
            assert (scale.dtype, scale.shape) == ("F32", tuple(linear.weight_scale_inv.shape))
            assert DTYPES[scale.dtype].torch == str(linear.weight_scale_inv.dtype).removeprefix("torch.")

    oss = json.loads((examples / "gpt-oss-20b" / "config.json").read_text())
    tiny = ModelShape.from_config({**oss, "num_hidden_layers": 2, "layer_types": oss["layer_types"][:2]})
    stored_oss = {s.name: s for s in tiny.stored_tensors()}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        blocks, scales = stored_oss[f"{name}_blocks"], stored_oss[f"{name}_scales"]
        assert name not in stored_oss and blocks.dtype == scales.dtype == "U8"
        small = (2, *blocks.shape[1:])  # two experts: the layout, not 32 experts' bytes
        decoded = convert_moe_packed_tensors(
            torch.zeros(small, dtype=torch.uint8), torch.full(small[:-1], 127, dtype=torch.uint8)
        )
        assert (blocks.shape[0], *decoded.shape[1:]) == blocks.of.shape
    assert stored_oss["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype is None  # biases stay bf16
    assert stored_oss["model.layers.0.self_attn.q_proj.weight"].dtype is None  # modules_to_not_convert
