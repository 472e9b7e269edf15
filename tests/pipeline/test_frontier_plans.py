"""Plans of the frontier releases from their public config.json alone (`shape_only: true`): DeepSeek-V3 (multi-head
latent attention, 3 dense layers then 256 experts and a shared one, weights released in FP8 with 128 x 128 block
scales, one multi-token-prediction layer) and gpt-oss-120b and -20b (biased attention with sinks, 128-token windows
on every other layer, experts released in MXFP4 beside bf16 attention). Every expected figure is worked out here
from the config's numbers, not from kiln's functions: parameters total and active, the source's bytes as released,
each bundle's bytes, KV bytes per token, each vLLM eval's tensor-parallel degree and memory per GPU in `kiln plan`,
and what a replica of the release as shipped takes on each GPU (resolve's `plan_replica`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from kiln.core.hardware import get_profile
from kiln.core.shape import ShapeRecord
from kiln.formats.architectures.shape import ModelShape
from kiln.placement.fit import plan_replica
from kiln.placement.model import active_parameters, kv_bytes_per_token, kv_cache_bytes, parameters
from kiln.placement.weights import artifact_bytes, source_bytes

if TYPE_CHECKING:
    from kiln.pipeline.report import PlanRow

EXAMPLES = Path(__file__).parents[2] / "examples"
GiB = 2**30
W, G = 2048, 32  # eval.window and the greedy tokens: a vLLM eval keeps one sequence of W + G
CONTEXT = W + G
PAGE_TOKENS = 16  # vLLM's pages on a GPU
# The GPUs: memory (GiB) and the tokens vLLM keeps in flight there (2 steps of 8,192 tokens from 70 GiB, of 16,384
# from 160 GiB).
GPUS = {"h100": (80, 16384), "h200": (141, 16384), "b200": (180, 32768)}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def config_of(example: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((EXAMPLES / example / "config.json").read_text())
    return config


def shape_of(example: str) -> ModelShape:
    return ModelShape.from_config(config_of(example))


# -- DeepSeek-V3 by hand ------------------------------------------------------------------------------------------
# hidden h, layers (3 dense, 58 sparse), heads H, query latent r_q, KV latent r_kv, each head's no-rope and rope query
# and key widths d_n and d_r, value width d_v, vocabulary V, dense MLP f, E experts of f_e (k per token) and one
# shared expert of f_e.
h, L, DENSE, H = 7168, 61, 3, 128
r_q, r_kv, d_n, d_r, d_v = 1536, 512, 128, 64, 128
V, f, E, k, f_e = 129280, 18432, 256, 8, 2048
SPARSE = L - DENSE
ATTENTION = [(r_q, h), (H * (d_n + d_r), r_q), (r_kv + d_r, h), (H * (d_n + d_v), r_kv), (h, H * d_v)]  # (rows, cols)
DENSE_MLP = [(f, h), (f, h), (h, f)]
EXPERT = [(f_e, h), (f_e, h), (h, f_e)]
SPARSE_MLP = EXPERT * (E + 1)  # the routed experts and the shared one
NORMS = 2 * h + r_q + r_kv  # a layer's two RMSNorms, the query latent's and the KV latent's
ROUTER = E * h + E  # the router and its score-correction bias


def elements(linears: list[tuple[int, int]]) -> int:
    return sum(r * c for r, c in linears)


DS_PARAMS = (
    L * (elements(ATTENTION) + NORMS)
    + DENSE * elements(DENSE_MLP)
    + SPARSE * (elements(SPARSE_MLP) + E * h)
    + 2 * V * h
    + h
)  # the correction biases (58 x 256) uncounted, as for every family's biases
DS_ACTIVE = DS_PARAMS - SPARSE * (E - k) * elements(EXPERT)
# The prediction layer: a sparse decoder layer, its embedding and head (V x h each), eh_proj (h x 2h), three norms.
DS_MTP = elements(ATTENTION) + NORMS + elements(SPARSE_MLP) + ROUTER + 2 * V * h + 2 * h * h + 3 * h
DS_KV_TOKEN = L * (r_kv + d_r) * 2  # one latent and rope key a layer, bf16


def fp8_block(linears: list[tuple[int, int]]) -> int:
    """FP8 E4M3 weights and a float32 scale per 128 x 128 block (partial blocks at the edges count whole)."""
    return sum(r * c + 4 * cdiv(r, 128) * cdiv(c, 128) for r, c in linears)


def ds_bytes(linear: Callable[[list[tuple[int, int]]], int]) -> int:
    """The model's tensors with each layer's Linears stored by `linear`, everything else bf16 (lm_head too)."""
    dense = linear(ATTENTION + DENSE_MLP) + 2 * NORMS
    sparse = linear(ATTENTION + SPARSE_MLP) + 2 * (NORMS + ROUTER)
    return DENSE * dense + SPARSE * sparse + 2 * (2 * V * h + h)


DS_FP8_SOURCE = ds_bytes(fp8_block)  # the release less its prediction layer
DS_MTP_BYTES = fp8_block(ATTENTION + SPARSE_MLP) + 2 * (NORMS + ROUTER) + 2 * (2 * V * h + 2 * h * h + 3 * h)
DS_BUNDLES = {
    "bf16": 2 * (DS_PARAMS + SPARSE * E),
    # The release's own FP8 blocks and float32 scales, kept as they are (the prediction layer left out).
    "fp8-block": DS_FP8_SOURCE,
    # kiln's FP8: a byte per weight and a bf16 scale per output row.
    "fp8": ds_bytes(lambda ls: sum(r * c + 2 * r for r, c in ls)),
    # NVFP4: E2M1 weights two a byte, an E4M3 scale per 16, float32 weight and input tensor scales.
    "nvfp4-w4a4": ds_bytes(lambda ls: sum(r * c // 2 + r * c // 16 + 4 + 4 for r, c in ls)),
}


def test_deepseek_v3_parameters_source_bytes_and_kv_per_token() -> None:
    shape, record = shape_of("deepseek-v3"), shape_of("deepseek-v3").record()
    assert parameters(record) == DS_PARAMS == 671_026_404_352  # "671B"
    assert active_parameters(record) == DS_ACTIVE == 37_552_282_624  # "37B activated"
    assert sum(t.elements for t in shape.tensors()) == DS_PARAMS + SPARSE * E
    assert sum(t.elements for t in shape.extra_tensors()) == DS_MTP  # 671B + 13.5B: the "685B" of its model card
    assert DS_PARAMS + SPARSE * E + DS_MTP == 684_489_845_504
    # The source as released: FP8 blocks, with its prediction layer ("≈ 690 GB"); what kiln builds from leaves it out.
    assert source_bytes(shape, 2) == DS_FP8_SOURCE + DS_MTP_BYTES == 688_574_809_152
    assert source_bytes(shape, 2, extras=False) == DS_FP8_SOURCE == 673_150_582_112
    # An fp8-block artifact keeps the source's tensors; the others change its format.
    config = config_of("deepseek-v3")
    for quant, expected in DS_BUNDLES.items():
        assert artifact_bytes(shape, config, 2, quant, "vllm") == expected, quant
    assert kv_bytes_per_token(record) == DS_KV_TOKEN == 70_272
    assert kv_bytes_per_token(record, "fp8") == DS_KV_TOKEN // 2
    # The registry sizes a release from its model_config, read as untrusted: the same latent, parameters and experts.
    untrusted = ShapeRecord.from_untrusted(config)
    assert isinstance(untrusted, ShapeRecord)
    assert kv_bytes_per_token(untrusted) == DS_KV_TOKEN and parameters(untrusted) == DS_PARAMS
    assert active_parameters(untrusted) == DS_ACTIVE


# -- gpt-oss by hand ----------------------------------------------------------------------------------------------
# hidden 2,880, 64 query and 8 KV heads of 64 with biases (q, k, v, o) and a sink each, E experts of width 2,880
# (gate and up stacked, 2 x 2,880, down), 4 per token, with biases, a router with a bias; vocabulary 201,088; every
# other layer slides over 128 tokens.
OSS_H, OSS_HEADS, OSS_KV, OSS_HD, OSS_F, OSS_V, OSS_K, OSS_WINDOW = 2880, 64, 8, 64, 2880, 201088, 4, 128
OSS = {"gpt-oss-120b": (36, 128), "gpt-oss-20b": (24, 32)}  # layers, experts
OSS_Q, OSS_KVW = OSS_HEADS * OSS_HD, OSS_KV * OSS_HD
OSS_ATTENTION = 2 * OSS_H * OSS_Q + 2 * OSS_H * OSS_KVW  # q, k, v, o
OSS_EXPERT = 3 * OSS_H * OSS_F  # gate_up (h x 2f) and down (f x h)


def oss(example: str) -> dict[str, int]:
    layers, experts = OSS[example]
    biases = (OSS_Q + 2 * OSS_KVW + OSS_H) + experts + experts * (2 * OSS_F + OSS_H)  # attention, router, experts
    counted = OSS_ATTENTION + 2 * OSS_H + experts * OSS_H + experts * OSS_EXPERT  # + the two norms, the router
    params = layers * counted + 2 * OSS_V * OSS_H + OSS_H
    tensors = params + layers * (biases + OSS_HEADS)  # + the sinks
    experts_weights = layers * experts * OSS_EXPERT
    return {
        "params": params,
        "tensors": tensors,
        "active": params - layers * (experts - OSS_K) * OSS_EXPERT,
        # MXFP4: 16 bytes of 32 values and a scale byte per 32 weights; the rest bf16.
        "source": experts_weights * 17 // 32 + 2 * (tensors - experts_weights),
        "bf16": 2 * tensors,
        "kv_token": layers * 2 * OSS_KVW * 2,
    }


@pytest.mark.parametrize("example", list(OSS))
def test_gpt_oss_parameters_source_bytes_and_kv_per_token(example: str) -> None:
    shape, hand = shape_of(example), oss(example)
    record = shape.record()
    assert parameters(record) == hand["params"] and active_parameters(record) == hand["active"]
    assert sum(t.elements for t in shape.tensors()) == hand["tensors"]
    assert source_bytes(shape, 2) == hand["source"]
    assert artifact_bytes(shape, config_of(example), 2, "bf16", "vllm") == hand["bf16"]
    assert kv_bytes_per_token(record) == hand["kv_token"]
    layers = OSS[example][0]
    assert kv_cache_bytes(record, 65536) == 2 * OSS_KVW * 2 * (layers // 2) * (65536 + OSS_WINDOW)
    # The model cards' figures: 116.83B (5.13B active, the embedding table left out) and 20.91B; 65 GB and 13.8 GB.
    figures = {"gpt-oss-120b": (116_829_156_672, 5_131_310_400), "gpt-oss-20b": (20_914_757_184, 3_607_283_520)}
    assert (hand["tensors"], hand["active"] - OSS_V * OSS_H) == figures[example]
    untrusted = ShapeRecord.from_untrusted(config_of(example))
    assert isinstance(untrusted, ShapeRecord)
    assert kv_bytes_per_token(untrusted) == hand["kv_token"] and parameters(untrusted) == hand["params"]
    assert (untrusted.sliding_window, untrusted.sliding_layers) == (OSS_WINDOW, layers // 2)


# -- kiln plan: each vLLM eval's GPUs -----------------------------------------------------------------------------


def vllm_kv(example: str, tp: int, in_flight: int) -> int:
    """One sequence of CONTEXT tokens on one of `tp` GPUs as vLLM pages it in 16-token pages. DeepSeek-V3: a page
    of each layer's 576-wide latent, whole on every GPU. gpt-oss: a group of the full layers and one of the sliding
    layers (as many of each), each page holding the GPU's KV heads' keys and values; the sliding group's window - 1
    and the tokens in flight (at most the sequence) and one page more."""
    pages = cdiv(CONTEXT, PAGE_TOKENS)
    if example == "deepseek-v3":
        return pages * L * PAGE_TOKENS * (r_kv + d_r) * 2
    group = OSS[example][0] // 2
    page = PAGE_TOKENS * 2 * (OSS_KV // tp) * OSS_HD * 2
    held = min(OSS_WINDOW - 1 + in_flight, CONTEXT)
    return (pages + cdiv(held, PAGE_TOKENS) + 1) * group * page


def weights(example: str, quant: str) -> int:
    return DS_BUNDLES[quant] if example == "deepseek-v3" else oss(example)[quant]


# The TP each vLLM eval takes on each GPU, None where 8 of them do not hold it (worked out below).
TP: dict[tuple[str, str], dict[str, int | None]] = {
    ("deepseek-v3", "h100"): {"bf16": None, "fp8-block": None, "nvfp4-w4a4": 8},
    ("deepseek-v3", "h200"): {"bf16": None, "fp8-block": 8, "nvfp4-w4a4": 4},
    ("deepseek-v3", "b200"): {"bf16": 8, "fp8-block": 4, "nvfp4-w4a4": 4},
    ("gpt-oss-120b", "h100"): {"bf16": 4},
    ("gpt-oss-120b", "h200"): {"bf16": 2},
    ("gpt-oss-120b", "b200"): {"bf16": 2},
    ("gpt-oss-20b", "h100"): {"bf16": 1},
}


@cache
def planned(example: str, gpu: str) -> dict[str, PlanRow]:
    """`kiln plan --json --device cuda --gpu GPU`'s rows for an example (the CLI's own function, in this process)."""
    import tempfile

    from kiln.pipeline import build
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.requirements import planning_device
    from kiln.pipeline.store import open_store

    recipe = load_recipe(EXAMPLES / example / "kiln.yaml")
    with tempfile.TemporaryDirectory() as work:
        rows = build.status(recipe, open_store(None, Path(work)), device=planning_device("cuda", gpu), gpu=gpu)
    assert {r.state for r in rows} == {"shape only"}
    return {r.node: r for r in rows}


@pytest.mark.parametrize("example", ["deepseek-v3", *OSS])
def test_each_example_is_its_public_config_json(example: str) -> None:
    config = config_of(example)
    if example == "deepseek-v3":
        assert (config["hidden_size"], config["num_hidden_layers"], config["first_k_dense_replace"]) == (h, L, DENSE)
        assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (r_q, r_kv, d_r)
        assert (config["n_routed_experts"], config["num_experts_per_tok"], config["n_shared_experts"]) == (E, k, 1)
        assert config["num_nextn_predict_layers"] == 1
        assert config["quantization_config"] == {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    else:
        layers, experts = OSS[example]
        assert (config["hidden_size"], config["num_hidden_layers"], config["num_local_experts"]) == (
            OSS_H,
            layers,
            experts,
        )
        assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
        assert config["sliding_window"] == OSS_WINDOW and config["quantization_config"]["quant_method"] == "mxfp4"
    recipe = yaml.safe_load((EXAMPLES / example / "kiln.yaml").read_text())
    assert recipe["shape_only"] is True and recipe["eval"]["window"] == W
    assert "huggingface.co/" in (EXAMPLES / example / "README.md").read_text()


@pytest.mark.parametrize(("example", "gpu"), list(TP), ids=[f"{e}-{g}" for e, g in TP])
def test_each_vllm_eval_takes_the_tp_the_hand_calculation_gives(example: str, gpu: str) -> None:
    memory_gib, in_flight = GPUS[gpu]
    usable = int(0.9 * memory_gib * GiB)  # vLLM's gpu_memory_utilization
    rows = planned(example, gpu)
    # ingest reads the source as released: FP8 blocks with the prediction layer, or MXFP4 experts.
    source = DS_FP8_SOURCE + DS_MTP_BYTES if example == "deepseek-v3" else oss(example)["source"]
    assert rows["ingest/source"].disk.read_bytes == source
    for quant, expected in TP[(example, gpu)].items():

        def share(tp: int, quant: str = quant) -> int:
            return cdiv(weights(example, quant), tp) + vllm_kv(example, tp, in_flight)

        # The smallest power of two whose share fits (every one divides the heads); where none does, 8 and "does not
        # fit".
        tp = next((t for t in (1, 2, 4, 8) if share(t) <= usable), None)
        assert tp == expected, quant
        node = rows[f"eval/hf-bundle-{quant}@vllm"].requires
        assert (node.gpus, node.device_memory_bytes, node.fits) == (tp or 8, share(tp or 8), tp is not None)
        assert node.accelerator == f"nvidia:{gpu}"


# -- the release as shipped, on each GPU (resolve's replica plan) -------------------------------------------------


def test_deepseek_v3_fp8_does_not_fit_8_h100_and_leaves_51_gb_a_gpu_for_kv_on_8_h200() -> None:
    record = shape_of("deepseek-v3").record()
    per_gpu = cdiv(DS_FP8_SOURCE, 8)  # 84.1 GB of weights on each of 8 GPUs
    h100 = plan_replica(get_profile("h100"), record, DS_FP8_SOURCE, "fp8-block", 4096, 1)
    assert (h100.tp, h100.fits, h100.weights_per_device_bytes) == (8, False, per_gpu)
    assert per_gpu > round(0.9 * 80 * GiB) == h100.usable_per_device_bytes  # the weights alone do not fit
    # 8 x H200: 51.0 GB a GPU left for the KV cache (90 % of the 139.8 GiB one process could allocate, as measured in
    # the hardware catalog, less the weights), which MLA keeps whole on every GPU: 16 tokens of every layer's latent
    # take 61 x 16 x 576 x 2 = 1,124,352 bytes, so sequences of 32K tokens take 2.3 GB each: 22 fit, 23 do not.
    measured = get_profile("h200").measured
    assert measured is not None and measured.allocatable_gib == 139.8
    room = round(0.9 * 139.8 * GiB) - per_gpu
    sequence = cdiv(32768, PAGE_TOKENS) * L * PAGE_TOKENS * (r_kv + d_r) * 2
    assert room // sequence == 22
    for concurrency, fits in ((22, True), (23, False)):
        h200 = plan_replica(get_profile("h200"), record, DS_FP8_SOURCE, "fp8-block", 32768, concurrency)
        assert (h200.tp, h200.fits, h200.kv_room_per_device_bytes) == (8, fits, room)
        assert h200.kv_per_device_bytes == concurrency * sequence
    assert "MLA: 576 cache elements a token and layer" in h200.explanation
    # 4 x B200 hold it with a 32K sequence (168.3 GB of weights a GPU of 173.9 usable); 2 do not.
    b200 = plan_replica(get_profile("b200"), record, DS_FP8_SOURCE, "fp8-block", 32768, 1)
    assert (b200.tp, b200.fits) == (4, True)
    assert cdiv(DS_FP8_SOURCE, 4) + sequence <= round(0.9 * 180 * GiB) < cdiv(DS_FP8_SOURCE, 2)


@pytest.mark.parametrize(
    ("example", "gpu", "in_flight"), [("gpt-oss-120b", "h100", 16384), ("gpt-oss-20b", "l40s", 4096)]
)
def test_gpt_oss_as_released_serves_a_128k_sequence_on_one_gpu(example: str, gpu: str, in_flight: int) -> None:
    """The MXFP4 release on one GPU with a 131,072-token sequence: every token in the full layers, the window and the
    tokens in flight in the sliding ones. (The quant only names the matmul type of the speed bounds: the fit is the
    weights' bytes and the KV cache's.)"""
    context = 131072
    hand = oss(example)
    group = OSS[example][0] // 2
    page = PAGE_TOKENS * 2 * OSS_KV * OSS_HD * 2
    kv = (cdiv(context, PAGE_TOKENS) + cdiv(OSS_WINDOW - 1 + in_flight, PAGE_TOKENS) + 1) * group * page
    replica = plan_replica(get_profile(gpu), shape_of(example).record(), hand["source"], "bf16", context, 1)
    assert (replica.tp, replica.fits, replica.kv_per_device_bytes) == (1, True, kv)
    assert hand["source"] + kv <= replica.usable_per_device_bytes
