"""Resolve's replica plans of a mixture of experts and of a sliding-window model, from the examples' public
config.json: a Qwen3-30B-A3B replica's decode reads the experts its tokens touch (8 of 128 a layer at batch 1,
128·(1 − (120/128)^B) expected at batch B), and a Gemma 3 27B replica's KV cache keeps a sliding layer's window
(as vLLM pages it), not every token. Each figure is worked out here from the config's numbers; the H100 has no
measured record, so the bounds rest on its data sheet (3,350 GB/s, 989 bf16 TFLOP/s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.hardware import get_profile
from kiln.core.shape import ShapeRecord
from kiln.formats.architectures.shape import ModelShape
from kiln.placement.fit import plan_replica

EXAMPLES = Path(__file__).parents[2] / "examples"
GiB = 2**30
BANDWIDTH, TFLOPS = 3350e9, 989e12  # H100, spec
USABLE = round(0.9 * 80 * GiB)

# Qwen3-30B-A3B: 48 layers of 128 experts (gate, up, down of 2048 x 768), 8 per token; 4 KV heads of 128.
L, E, K, H, FE = 48, 128, 8, 2048, 768
EXPERT = 3 * H * FE  # 4,718,592 parameters
PARAMS = 30_532_110_336  # tests/pipeline/test_moe_plans.py works it out from the config
ACTIVE = PARAMS - L * (E - K) * EXPERT
assert ACTIVE == 3_353_020_416
BF16 = 61_064_245_248  # its bf16 checkpoint: 2 bytes of each of its 30,532,122,624 elements
KV_TOKEN = 2 * L * 4 * 128 * 2  # 98,304 bytes a token


def example(name: str) -> ShapeRecord:
    return ModelShape.from_config(json.loads((EXAMPLES / name / "config.json").read_text())).record()


def test_qwen3_30b_decode_reads_the_active_experts_at_batch_1() -> None:
    context = 4096
    plan = plan_replica(get_profile("h100"), example("qwen3-30b-a3b"), BF16, "bf16", context, 1)
    kv = KV_TOKEN * context  # whole 16-token pages
    assert (plan.tp, plan.fits, plan.kv_cache_bytes) == (1, True, kv) and BF16 + kv <= USABLE
    # A step reads the attention, norms, embeddings and 8 experts a layer: 11 % of the weights, and the KV cache.
    read = BF16 * ACTIVE / PARAMS + kv
    memory_s, compute_s = read / BANDWIDTH, 2 * ACTIVE / TFLOPS
    assert memory_s > compute_s
    assert plan.decode_tokens_per_s_per_sequence == pytest.approx(1 / memory_s, rel=1e-12)
    assert round(plan.decode_tokens_per_s_per_sequence) == 471  # a dense model of these 61 GB: 54.5
    assert "a decode step of 1 reads 11% of the weights (8 of 128 experts per token)" in plan.explanation
    # Prefill computes with the active parameters: 2 FLOPs each per token, and attention's 2·L·heads·hd·T².
    flops = 2 * ACTIVE * context + 2 * L * 32 * 128 * context**2
    assert plan.ttft_s == pytest.approx(flops / TFLOPS, rel=1e-12)


@pytest.mark.parametrize("batch", [4, 32])
def test_qwen3_30b_decode_at_batch_b_reads_the_experts_its_tokens_are_expected_to_touch(batch: int) -> None:
    context = 4096
    plan = plan_replica(get_profile("h100"), example("qwen3-30b-a3b"), BF16, "bf16", context, batch)
    # B tokens routed independently, k of E each: E·(1 − (1 − k/E)^B) distinct experts a layer (29.1 at 4, 111.8
    # at 32), not B·k.
    touched = E * (1 - (1 - K / E) ** batch)
    assert 8 < touched < min(batch * K, E)
    read_params = round(PARAMS - L * (E - touched) * EXPERT)
    kv = KV_TOKEN * context * batch
    assert (plan.tp, plan.kv_cache_bytes) == (1, kv) and BF16 + kv <= USABLE
    memory_s = (BF16 * read_params / PARAMS + kv) / BANDWIDTH
    compute_s = 2 * ACTIVE * batch / TFLOPS  # each token computes with its own 8 experts
    assert plan.decode_tokens_per_s == pytest.approx(batch / max(memory_s, compute_s), rel=1e-12)
    share = f"{BF16 * read_params / PARAMS / BF16:.0%}"
    assert f"a decode step of {batch} reads {share} of the weights" in plan.explanation


# Gemma 3 27B: 62 layers, 52 sliding over 1,024 tokens, 10 global; 16 KV heads of 128.
GEMMA_BF16 = 54_018_692_608
PAGE = 16 * 2 * 16 * 128 * 2  # one layer's 16 tokens of bf16 keys and values: 131,072 bytes
IN_FLIGHT = 2 * 8192  # vLLM on an H100: 8,192 tokens a step, two steps in flight


def gemma_kv(context: int, tp: int = 1) -> int:
    """vLLM's pages of one sequence: groups of 10 layers (the 10 global; the 52 sliding in 6 groups, the last
    padded), a block a page of each; a global group takes a block per 16 tokens, a sliding group its window -
    1 + the tokens in flight, and one more."""
    held = min(1024 - 1 + IN_FLIGHT, context)
    blocks = 1 * -(-context // 16) + 6 * (-(-held // 16) + 1)
    return blocks * 10 * PAGE // tp


def test_a_gemma3_replica_keeps_a_sliding_layers_window_of_kv_not_every_token() -> None:
    context = 65536
    gemma = example("gemma-3-27b")
    assert (gemma.sliding_layers, gemma.sliding_window) == (52, 1024)
    plan = plan_replica(get_profile("h100"), gemma, GEMMA_BF16, "bf16", context, 1)
    kv = gemma_kv(context)
    assert kv == (4096 + 6 * 1089) * 10 * PAGE == 13_932_953_600
    assert (plan.tp, plan.fits, plan.kv_cache_bytes, plan.kv_per_device_bytes) == (1, True, kv, kv)
    assert "52 of 62 layers slide: each sequence keeps 17407 of its 65536 tokens there" in plan.explanation
    # Every layer keeping every token would not fit one H100 with the weights: 62 x 4,096 pages.
    uncapped = 62 * (context // 16) * PAGE
    assert GEMMA_BF16 + uncapped > USABLE >= GEMMA_BF16 + kv
    dense = plan_replica(
        get_profile("h100"), gemma.model_copy(update={"sliding_window": None}), GEMMA_BF16, "bf16", context, 1
    )
    assert (dense.tp, dense.kv_cache_bytes) == (2, uncapped)
    # Decode reads what attention reads: the global layers' 65,536 tokens, the sliding layers' last 1,024.
    read = 2 * 16 * 128 * 2 * (10 * context + 52 * 1024)
    assert plan.decode_tokens_per_s_per_sequence == pytest.approx(BANDWIDTH / (GEMMA_BF16 + read), rel=1e-12)


def test_below_the_window_a_gemma3_sliding_layer_keeps_every_token_and_a_page_more() -> None:
    # 1,000 tokens: 63 pages in each group, and a sliding group's one more (the window may straddle a page).
    plan = plan_replica(get_profile("h100"), example("gemma-3-27b"), GEMMA_BF16, "bf16", 1000, 4)
    assert plan.kv_cache_bytes == 4 * gemma_kv(1000) == 4 * (63 + 6 * 64) * 10 * PAGE
    assert "layers slide" not in plan.explanation
