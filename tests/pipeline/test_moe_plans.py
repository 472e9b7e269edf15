"""Plans of four large models from their public config.json alone (`shape_only: true`): Qwen3-235B-A22B and
Qwen3-30B-A3B (mixtures of 128 experts, 8 per token), Mixtral-8x22B (8 experts, 2 per token) and Gemma 3 27B
(52 sliding-window layers, 10 global). Every expected figure is worked out here from the config's numbers:
parameters total and active, each quant's weight bytes, KV bytes per token, and for each vLLM eval on a catalog
GPU its tensor-parallel degree and memory per device (the weights' share and one sequence's KV cache, paged as
vLLM pages it) — then compared with what `kiln plan` prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from kiln.formats.architectures.shape import ModelShape
from kiln.placement.model import active_parameters, kv_bytes_per_token, kv_cache_bytes, parameters

if TYPE_CHECKING:
    from kiln.pipeline.requirements import Requirements

EXAMPLES = Path(__file__).parents[2] / "examples"
GiB = 2**30
W, G = 2048, 32  # eval.window and the greedy tokens (the default): a vLLM eval keeps one sequence of W + G
CONTEXT = W + G
QUANTS = ("bf16", "fp8", "w4a16-gptq")


@dataclass(frozen=True)
class Hand:
    """A model as its config.json gives it: hidden size h, L layers, attention heads of hd, KV heads, vocabulary
    V, an MLP of width f (each expert's, for a mixture of E experts of which k run per token), RMSNorms per layer
    (q/k norms of hd besides, where `qk_norm`), and its sliding layers of `window` tokens."""

    example: str
    h: int
    L: int
    heads: int
    kv_heads: int
    hd: int
    V: int
    f: int
    E: int = 0
    k: int = 0
    norms: int = 2
    qk_norm: bool = False
    tied: bool = False
    sliding: int = 0
    window: int | None = None

    @property
    def q(self) -> int:
        return self.heads * self.hd

    @property
    def kv(self) -> int:
        return self.kv_heads * self.hd

    def linears(self) -> list[tuple[int, int]]:
        """One layer's Linear weights, (rows, columns): q, k, v, o and the MLP's gate, up, down (each expert's)."""
        attention = [(self.q, self.h), (self.kv, self.h), (self.kv, self.h), (self.h, self.q)]
        mlp = [(self.f, self.h), (self.f, self.h), (self.h, self.f)]
        return attention + mlp * max(self.E, 1)

    @property
    def other(self) -> int:
        """One layer's tensors that stay bf16: its norms and, in a mixture, the router (E x h)."""
        return self.norms * self.h + (2 * self.hd if self.qk_norm else 0) + self.E * self.h

    @property
    def elements(self) -> int:
        """Every tensor of the checkpoint: the layers, the embedding (and an untied head), the final norm."""
        per_layer = sum(r * c for r, c in self.linears()) + self.other
        return self.L * per_layer + self.V * self.h * (1 if self.tied else 2) + self.h

    @property
    def params(self) -> int:
        """`placement.model.parameters`' count: each layer's attention, two norms, its MLP or its router and every
        expert; embeddings, head, final norm (q/k norms and Gemma's second pair of norms, under 0.01 %, not)."""
        attention = 2 * self.h * self.q + 2 * self.h * self.kv + 2 * self.h
        mlp = 3 * self.h * self.f * max(self.E, 1) + self.E * self.h
        return self.L * (attention + mlp) + self.V * self.h * (1 if self.tied else 2) + self.h

    def active(self, batch: int = 1) -> int:
        """Parameters a decode step of `batch` tokens reads: all but the experts none of them is routed to,
        E·(1 − (1 − k/E)^batch) of each layer's E touched."""
        if not self.E:
            return self.params
        touched = self.E * (1 - (1 - self.k / self.E) ** batch)
        return round(self.params - self.L * (self.E - touched) * 3 * self.h * self.f)

    def weights(self, quant: str) -> int:
        """The hf-bundle's tensor bytes: bf16 everywhere; FP8, a byte per Linear weight and a bf16 scale per row;
        W4A16, int4 packed eight to an int32, a bf16 scale per 128 columns and an int64 [2] shape per Linear."""
        linear = sum(r * c for r, c in self.linears())
        rest = 2 * (self.elements - self.L * linear)
        if quant == "bf16":
            return 2 * self.elements
        if quant == "fp8":
            return self.L * sum(r * c + 2 * r for r, c in self.linears()) + rest
        assert all(c % 128 == 0 for _, c in self.linears())
        return self.L * sum(r * c // 2 + 2 * r * c // 128 + 16 for r, c in self.linears()) + rest

    def kv_per_token(self) -> int:
        """bf16 keys and values of one token in every layer."""
        return 2 * self.L * self.kv * 2

    def vllm_kv(self, tp: int, in_flight: int) -> int:
        """One sequence of CONTEXT tokens on one of `tp` GPUs as vLLM pages it: 16-token pages of one layer's keys
        and values (KV heads split over TP, one each past their count). Every layer one group, or, with sliding
        layers, groups of the fewer kind's count: a full group takes a page per 16 tokens, a sliding group its
        window - 1 + the tokens in flight (at most the sequence) and one page more."""
        page = 16 * 2 * max(self.kv_heads // tp, 1) * self.hd * 2
        pages = -(-CONTEXT // 16)
        if not self.sliding:
            return self.L * pages * page
        group = min(self.sliding, self.L - self.sliding)
        held = min(self.window - 1 + in_flight, CONTEXT)  # type: ignore[operator]
        blocks = -(-(self.L - self.sliding) // group) * pages + -(-self.sliding // group) * (-(-held // 16) + 1)
        return blocks * group * page


QWEN3_235B = Hand(
    "qwen3-235b-a22b", h=4096, L=94, heads=64, kv_heads=4, hd=128, V=151936, f=1536, E=128, k=8, qk_norm=True
)
QWEN3_30B = Hand("qwen3-30b-a3b", h=2048, L=48, heads=32, kv_heads=4, hd=128, V=151936, f=768, E=128, k=8, qk_norm=True)
MIXTRAL = Hand("mixtral-8x22b", h=6144, L=56, heads=48, kv_heads=8, hd=128, V=32000, f=16384, E=8, k=2)
# Gemma 3 27B: a sliding layer five in six (layers 6, 12, ..., 60 global: 10), sandwich norms (4 a layer), tied.
GEMMA3 = Hand(
    "gemma-3-27b", h=5376, L=62, heads=32, kv_heads=16, hd=128, V=262208, f=21504, norms=4, qk_norm=True,
    tied=True, sliding=52, window=1024,
)  # fmt: skip
MODELS = {m.example: m for m in (QWEN3_235B, QWEN3_30B, MIXTRAL, GEMMA3)}

# The figures these come to, to the parameter (public model cards: 235B / 22B, 30.5B / 3.3B, 141B / 39B, 27B).
HEADLINES = {
    "qwen3-235b-a22b": (235_093_610_496, 22_190_739_456),
    "qwen3-30b-a3b": (30_532_110_336, 3_353_020_416),
    "mixtral-8x22b": (140_620_634_112, 39_152_031_744),
    "gemma-3-27b": (27_008_663_808, 27_008_663_808),
}
# The smallest TP each vLLM eval takes on each GPU (worked out below; pinned here as the plan's headline).
TP = {
    ("qwen3-235b-a22b", "h100"): {"bf16": 8, "fp8": 4, "w4a16-gptq": 2},
    ("qwen3-235b-a22b", "h200"): {"bf16": 4, "fp8": 2, "w4a16-gptq": 1},
    ("qwen3-235b-a22b", "b200"): {"bf16": 4, "fp8": 2, "w4a16-gptq": 1},
    ("qwen3-30b-a3b", "h100"): {"bf16": 1, "fp8": 1, "w4a16-gptq": 1},
    ("mixtral-8x22b", "h100"): {"bf16": 4, "fp8": 2, "w4a16-gptq": 1},
    ("mixtral-8x22b", "h200"): {"bf16": 4, "fp8": 2, "w4a16-gptq": 1},
    ("mixtral-8x22b", "b200"): {"bf16": 2, "fp8": 1, "w4a16-gptq": 1},
    ("gemma-3-27b", "h100"): {"bf16": 1, "fp8": 1, "w4a16-gptq": 1},
    ("gemma-3-27b", "h200"): {"bf16": 1, "fp8": 1, "w4a16-gptq": 1},
}
# The GPUs: memory (GiB) and vLLM's tokens in flight there (2 steps of max_num_batched_tokens: 8,192 from 70 GiB,
# 16,384 from 160 GiB).
GPUS = {"h100": (80, 16384), "h200": (141, 16384), "b200": (180, 32768)}


def shape_of(m: Hand) -> Any:
    return ModelShape.from_config(json.loads((EXAMPLES / m.example / "config.json").read_text())).record()


Plan = Callable[[str, str], dict[str, "Requirements"]]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """`kiln plan --json --device cuda --gpu GPU`'s rows for an example (the CLI's own function, in this process),
    each planned once."""
    from kiln.pipeline import build
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.requirements import planning_device
    from kiln.pipeline.store import open_store

    work = tmp_path_factory.mktemp("plans")

    @cache
    def plan(example: str, gpu: str) -> dict[str, Requirements]:
        recipe = load_recipe(EXAMPLES / example / "kiln.yaml")
        rows = build.status(recipe, open_store(None, work), device=planning_device("cuda", gpu), gpu=gpu)
        assert {r.state for r in rows} == {"shape only"}
        return {r.node: r.requires for r in rows}

    return plan


@pytest.mark.parametrize("m", list(MODELS.values()), ids=list(MODELS))
def test_each_example_is_its_public_config_json(m: Hand) -> None:
    example = EXAMPLES / m.example
    config = json.loads((example / "config.json").read_text())
    text = config.get("text_config", config)
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]) == (m.h, m.L, m.heads)
    assert (text["num_key_value_heads"], text.get("head_dim", m.h // m.heads), text["vocab_size"]) == (
        m.kv_heads,
        m.hd,
        m.V,
    )
    assert text.get("moe_intermediate_size", text["intermediate_size"]) == m.f
    assert text.get("num_experts", text.get("num_local_experts", 0)) == m.E
    assert text.get("num_experts_per_tok", 0) == m.k
    recipe = yaml.safe_load((example / "kiln.yaml").read_text())
    assert recipe["shape_only"] is True and (recipe["eval"]["window"], recipe.get("greedy_tokens", G)) == (W, G)
    assert "huggingface.co/" in (example / "README.md").read_text()  # where config.json was taken from


@pytest.mark.parametrize("m", list(MODELS.values()), ids=list(MODELS))
def test_parameters_total_active_and_kv_per_token_equal_the_hand_calculation(m: Hand) -> None:
    shape = shape_of(m)
    assert parameters(shape) == m.params == HEADLINES[m.example][0]
    assert active_parameters(shape) == m.active() == HEADLINES[m.example][1]
    assert abs(m.elements - m.params) < 1e-4 * m.params  # the tensors placement leaves uncounted
    for batch in (4, 64):  # more tokens a step touch more experts: at 64, Qwen3 touches ~126 of 128
        assert active_parameters(shape, batch) == m.active(batch)
    assert kv_bytes_per_token(shape) == m.kv_per_token()
    if m.sliding:  # a sliding layer keeps at most its window: at 32K, 10 layers hold 32,768 tokens, 52 hold 1,024
        assert kv_cache_bytes(shape, 32768) == 2 * m.kv * 2 * ((m.L - m.sliding) * 32768 + m.sliding * m.window)  # type: ignore[operator]


@pytest.mark.parametrize(("example", "gpu"), list(TP), ids=[f"{e}-{g}" for e, g in TP])
def test_each_vllm_eval_takes_the_tp_the_hand_calculation_gives(planned: Plan, example: str, gpu: str) -> None:
    m, (memory_gib, in_flight) = MODELS[example], GPUS[gpu]
    usable = int(0.9 * memory_gib * GiB)  # vLLM's gpu_memory_utilization
    req = planned(example, gpu)
    for quant in QUANTS:
        weights = m.weights(quant)

        def share(tp: int, weights: int = weights) -> int:
            return -(-weights // tp) + m.vllm_kv(tp, in_flight)

        # The smallest power of two the heads divide (KV heads divide or replicate evenly) whose share fits.
        tp = next(t for t in (1, 2, 4, 8) if m.heads % t == 0 and share(t) <= usable)
        assert tp == TP[(example, gpu)][quant], quant
        assert tp == 1 or share(tp // 2) > usable
        node = req[f"eval/hf-bundle-{quant}@vllm"]
        assert (node.gpus, node.device_memory_bytes, node.fits) == (tp, share(tp), True), quant
        assert node.accelerator == f"nvidia:{gpu}" and node.runtime_env == "vllm==0.32.0"


def test_kiln_plan_prints_each_stage_and_the_tp_of_the_vllm_evals(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kiln", "plan", str(EXAMPLES / "qwen3-235b-a22b" / "kiln.yaml"), "--device", "cuda"]
        + ["--gpu", "h100", "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.split("│")[1].strip(): line for line in out.stderr.splitlines() if line.count("│") > 3}
    assert "cuda x 8: 54.8 GiB" in lines["eval/hf-bundle-bf16@vllm"]  # 470 GB over 8 H100s
    assert "cuda x 4: 55.2 GiB" in lines["eval/hf-bundle-fp8@vllm"]
    assert "cuda x 2: 57.5 GiB" in lines["eval/hf-bundle-w4a16-gptq@vllm"]
    assert "shape only" in lines["reference/source"] and "cuda: " in lines["reference/source"]
