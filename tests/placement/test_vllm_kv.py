"""kiln's KV cache figures equal vLLM's own accounting: each family's tiny model loaded by vLLM 0.32 (the CPU
build, in its own environment: `kiln runtime install vllm`, which `make test` runs first), its engine asked how
it paged the KV cache (the worker's `kv_cache` request), and `placement.model` asked the same of the model's
shape alone: bytes per token and per page, blocks of a given memory, groups of layers, and the capacity in tokens
vLLM reports, the sliding layers' cap included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.eval.runtimes.environments import find
from kiln.eval.runtimes.vllm_runtime import (
    CPU_IN_FLIGHT_TOKENS,
    KV_CACHE_BYTES,
    WorkerError,
    WorkerProcess,
    kv_cache_reservation,
)
from kiln.formats.architectures import FAMILIES
from kiln.formats.architectures.shape import ModelShape
from kiln.placement.model import (
    NULL_BLOCKS,
    VLLM_CPU_BLOCK_SIZE,
    kv_bytes_per_token,
    kv_cache_bytes,
    paged_kv_cache,
    sliding_layer_count,
    vllm_defaults,
)
from tests.model_factory import make_model

# Longer than a sliding layer's admission (its window - 1 + the 4,096 tokens vLLM's LLM class schedules a step on
# the CPU) and no multiple of a page: every rounding and the window's cap show.
MAX_MODEL_LEN = 5000
# A pool that is no whole number of blocks of any case.
MEMORY = 48 * 2**20 + 12345
ELEMENT = {"bfloat16": 2, "float32": 4}


def alternating(layers: int, every: int) -> list[str]:
    """Gemma 3's layer types: every `every`-th layer global, the rest sliding."""
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]


# name: (family, config beyond the shared tiny sizes, vLLM's dtype, block size (None: vLLM's CPU default)).
# Heads of 64 (hidden 256 over 4 heads), which vLLM's CPU attention takes.
CASES: dict[str, tuple[str, dict[str, Any], str, int | None]] = {
    "llama": ("llama", {}, "bfloat16", None),
    "qwen3": ("qwen3", {}, "bfloat16", None),
    "qwen3_moe": ("qwen3_moe", {}, "bfloat16", None),
    "mixtral": ("mixtral", {"sliding_window": None}, "bfloat16", None),
    "phi3": ("phi3", {}, "float32", None),
    # Every layer slides: one group, each sequence capped at the window (+ the steps in flight).
    "phi3-window": ("phi3", {"sliding_window": 256}, "bfloat16", None),
    "mixtral-window": ("mixtral", {"sliding_window": 256}, "bfloat16", None),
    # Gemma 3: 3 global and 4 sliding layers (groups of 4, the global group padded), and 5:1 as released
    # (7 sliding, 1 global: groups of 1), at pages of 32 tokens too (vLLM's CPU
    # attention takes multiples of 32: `CPUAttentionBackend.get_supported_kernel_block_sizes`).
    "gemma3": ("gemma3", {"num_layers": 7, "sliding_window": 256, "layer_types": alternating(7, 2)}, "bfloat16", None),
    # gpt-oss: sliding (16 tokens, FAMILY_CONFIG) and full layers alternating, sinks (which keep no cache).
    "gpt_oss": ("gpt_oss", {"head_dim": 64, "intermediate_size": 128}, "bfloat16", None),
    # DeepSeek-V3: MLA's one latent per layer, of DeepSeek's size (the only one vLLM's CPU MLA kernel takes), with
    # YaRN as released; vLLM's CPU build pages it 16 tokens a page whatever is asked.
    "deepseek_v3": (
        "deepseek_v3",
        {
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "q_lora_rank": 64,
            "moe_intermediate_size": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
        },
        "bfloat16",
        None,
    ),
    "gemma3-5to1": (
        "gemma3",
        {"num_layers": 8, "sliding_window": 256, "layer_types": alternating(8, 6)},
        "float32",
        32,
    ),
}


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    installed = find("vllm")
    if installed is None:
        pytest.fail("vLLM's environment is not installed: `kiln runtime install vllm` (make test runs it)")
    w = WorkerProcess(installed.python)
    yield w
    w.close()


def tiny(root: Path, name: str) -> Path:
    family, extra, _, _ = CASES[name]
    config: dict[str, Any] = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "num_layers": 4, **extra}
    out = make_model(root / name, family, vocab_size=512, **config)
    # make_model writes 512 positions; vLLM refuses a max_model_len past the config's. The keys every kiln artifact
    # adds to the config (`implied_config`: DeepSeek-V3's routing, which vLLM reads) as a bundle of it would have.
    path = out / "config.json"
    implied = dict(FAMILIES[family].implied_config)
    path.write_text(json.dumps({**implied, **json.loads(path.read_text()), "max_position_embeddings": 8192}))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_kiln_counts_the_kv_cache_as_vllm_pages_it(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory, name: str
) -> None:
    _, _, dtype, block_size = CASES[name]
    model = tiny(tmp_path_factory.mktemp("vllm-kv"), name)
    request: dict[str, Any] = {
        "op": "load",
        "model": str(model),
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_bytes": MEMORY,
        "full_vocab_limit": 1 << 20,
        "top_k": 8,
        "dtype": dtype,
    }
    if block_size is not None:
        request["block_size"] = block_size
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text())).record()
    worker.request(request)
    try:
        vllm = worker.request({"op": "kv_cache"})[0]
    finally:
        worker.request({"op": "unload"})
    element = ELEMENT[dtype]

    # vLLM's own defaults and budget on the CPU: the page kiln assumes there, the in-flight tokens it reported.
    page = vllm_defaults("cpu", 64, mla=shape.is_mla).block_size
    assert vllm["block_size"] == (block_size or page) and vllm_defaults("cpu", 64).block_size == VLLM_CPU_BLOCK_SIZE
    assert vllm["max_model_len"] == MAX_MODEL_LEN and vllm["kv_cache_memory_bytes"] == MEMORY
    paged = paged_kv_cache(
        shape, block_size=vllm["block_size"], in_flight_tokens=vllm["max_in_flight_tokens"], element_bytes=element
    )

    # Bytes per token: each layer's page over its tokens, summed over the layers of every group.
    per_layer_token = {g["page_bytes"] // g["block_size"] for g in vllm["groups"]}
    assert per_layer_token == {paged.page_bytes // paged.block_size}
    assert all(g["page_bytes"] == paged.page_bytes for g in vllm["groups"])
    layers = sum(g["layers"] for g in vllm["groups"])
    assert layers == shape.num_layers
    assert layers * per_layer_token.pop() == kv_bytes_per_token(shape, element_bytes=element)

    # The groups: how many of each kind, and the layers in each (a block holds a page of each).
    kinds = [g["kind"] for g in vllm["groups"]]
    # MLA's layers attend to everything: vLLM's MLAAttentionSpec is a FullAttentionSpec of one latent "head".
    full = ("MLAAttentionSpec",) if shape.is_mla else ("FullAttentionSpec",)
    assert sum(kind in full for kind in kinds) == paged.full_groups
    assert kinds.count("SlidingWindowSpec") == paged.sliding_groups
    assert max(g["layers"] for g in vllm["groups"]) == paged.group_size
    windows = {g["sliding_window"] for g in vllm["groups"] if g["kind"] == "SlidingWindowSpec"}
    assert windows == ({shape.sliding_window} if sliding_layer_count(shape) else set())

    # The pool's blocks of that memory, and the capacity vLLM reports for sequences of MAX_MODEL_LEN.
    assert vllm["num_blocks"] == paged.blocks(MEMORY)
    assert vllm["pool_bytes"] == paged.blocks(MEMORY) * paged.block_bytes
    assert vllm["max_concurrency"] == paged.max_concurrency(MEMORY, MAX_MODEL_LEN)
    assert vllm["kv_cache_size_tokens"] == paged.capacity_tokens(MEMORY, MAX_MODEL_LEN)

    # The sliding layers' cap: past its window (and the steps in flight) a sequence's growth takes pages of the
    # full layers only. vLLM's blocks per sequence, num_blocks / max_concurrency, agree with kiln's above.
    pages = -(-MAX_MODEL_LEN // paged.block_size)
    longer = paged.blocks_per_sequence(2 * MAX_MODEL_LEN) - paged.blocks_per_sequence(MAX_MODEL_LEN)
    assert longer == paged.full_groups * (-(-2 * MAX_MODEL_LEN // paged.block_size) - pages)
    if not sliding_layer_count(shape):
        # Whole pages of every layer: the exact count of MAX_MODEL_LEN tokens, rounded up to a page.
        exact = kv_cache_bytes(shape, MAX_MODEL_LEN, element_bytes=element)
        assert paged.bytes(MAX_MODEL_LEN) == pages * paged.block_size * exact // MAX_MODEL_LEN


def test_the_cpu_eval_reserves_the_kv_cache_of_one_sequence_which_vllm_needs(tmp_path: Path) -> None:
    """The CPU eval asks vLLM for one sequence's pages (`kv_cache_reservation`, past its 256 MiB floor): exactly
    what vLLM needs to start, a byte less and it refuses."""
    installed = find("vllm")
    assert installed is not None, "vLLM's environment is not installed: `kiln runtime install vllm`"
    model = tiny(tmp_path, "llama")
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text())).record()
    paged = paged_kv_cache(
        shape, block_size=VLLM_CPU_BLOCK_SIZE, in_flight_tokens=CPU_IN_FLIGHT_TOKENS, element_bytes=4
    )
    # 4 layers, 40 pages of 128 tokens and the block vLLM keeps back, 2 KV heads of 64, float32.
    need = paged.bytes(MAX_MODEL_LEN) + NULL_BLOCKS * paged.block_bytes
    assert need == 4 * (40 + 1) * 128 * 2 * 2 * 64 * 4
    assert kv_cache_reservation(shape, MAX_MODEL_LEN, 4) == max(need, KV_CACHE_BYTES) == KV_CACHE_BYTES
    longer = 200 * MAX_MODEL_LEN
    assert kv_cache_reservation(shape, longer, 4) == paged.bytes(longer) + paged.block_bytes > KV_CACHE_BYTES
    request = {
        "op": "load",
        "model": str(model),
        "max_model_len": MAX_MODEL_LEN,
        "full_vocab_limit": 1 << 20,
        "top_k": 8,
        "dtype": "float32",
    }
    for memory, starts in ((need, True), (need - 1, False)):
        worker = WorkerProcess(installed.python)  # a fresh worker each, as a build starts one
        try:
            if starts:
                worker.request({**request, "kv_cache_bytes": memory})
                blocks = worker.request({"op": "kv_cache"})[0]["num_blocks"]
                assert blocks == paged.blocks_per_sequence(MAX_MODEL_LEN) + NULL_BLOCKS
            else:
                with pytest.raises(WorkerError, match="KV cache is needed"):
                    worker.request({**request, "kv_cache_bytes": memory})
        finally:
            worker.close()


# DeepSeek-V3 and gpt-oss, from their released config.json (examples/): vLLM's accounting as vLLM 0.32's source writes
# it, worked out here (kiln's vLLM evals do not load these families yet: their records refuse vLLM, and the CPU build
# would take them only through CPU_MLA and its MXFP4 experts, unchecked).
#
# - MLA: vllm/model_executor/layers/attention/mla_attention.py `MLAAttention.get_kv_cache_spec` makes every layer an
#   `MLAAttentionSpec` of num_kv_heads=1, head_size = kv_lora_rank + qk_rope_head_dim and max_tp_shards=1 (every TP
#   rank holds the whole latent); vllm/v1/kv_cache_interface.py `MLAAttentionSpec.head_size_v = 0` and
#   `AttentionSpec.page_size_bytes` = heads x block_size x (head_size + head_size_v) x dtype bytes.
# - gpt-oss: vllm/model_executor/models/gpt_oss.py `OAIAttention` builds `Attention(num_kv_heads / tp, head_dim,
#   per_layer_sliding_window=sliding_window on even layers, sinks=...)`: a `SlidingWindowSpec` or `FullAttentionSpec`
#   of head_size = head_size_v = head_dim (vllm/model_executor/layers/attention/attention.py `get_kv_cache_spec`);
#   the sinks are a parameter of the attention, no part of the spec. A sliding layer's admission is
#   cdiv(min(window - 1 + in-flight tokens, max_model_len), block_size) + 1 blocks
#   (`SlidingWindowSpec.max_admission_blocks_per_request`).
EXAMPLES = Path(__file__).parents[2] / "examples"


def released(example: str) -> Any:
    return ModelShape.from_config(json.loads((EXAMPLES / example / "config.json").read_text())).record()


def test_mla_caches_one_latent_a_token_and_layer_as_vllm_counts_it() -> None:
    shape = released("deepseek-v3")
    layers, latent, rope = 61, 512, 64  # num_hidden_layers, kv_lora_rank, qk_rope_head_dim
    head_size = latent + rope  # MLAAttentionSpec's one KV head: 576
    for dtype, element in (("bf16", 2), ("fp8", 1)):
        assert kv_bytes_per_token(shape, dtype) == layers * head_size * element  # 70,272 bytes in bf16
        for tp in (1, 8):  # max_tp_shards=1: each rank keeps all of it
            paged = paged_kv_cache(shape, block_size=16, kv_dtype=dtype, tp=tp)
            assert paged.page_bytes == 1 * 16 * (head_size + 0) * element  # 18,432 bytes in bf16
            assert (paged.group_size, paged.full_groups, paged.sliding_groups) == (layers, 1, 0)
            assert kv_cache_bytes(shape, 4096, kv_dtype=dtype, tp=tp) == 4096 * layers * head_size * element
    # Not every head's keys and values: 128 heads of 192-wide keys and 128-wide values would be 4,997,120 bytes a
    # token, 71 times as much.
    assert (shape.num_kv_heads, shape.head_dim, shape.v_head_dim) == (128, 192, 128)
    assert 71 * kv_bytes_per_token(shape) < layers * 128 * (192 + 128) * 2 == 4_997_120 < 72 * kv_bytes_per_token(shape)
    # A pool of MEMORY bytes: whole blocks of a page of each of the 61 layers; a sequence of MAX_MODEL_LEN takes
    # cdiv(5000, 16) = 313 of them.
    paged = paged_kv_cache(shape, block_size=16)
    assert paged.blocks(MEMORY) == MEMORY // (61 * 18_432) == 44
    assert paged.blocks_per_sequence(MAX_MODEL_LEN) == 313


@pytest.mark.parametrize(("example", "layers"), [("gpt-oss-120b", 36), ("gpt-oss-20b", 24)])
def test_gpt_oss_keeps_a_window_in_its_sliding_layers_and_nothing_for_its_sinks(example: str, layers: int) -> None:
    shape = released(example)
    kv_heads, head_dim, window = 8, 64, 128
    sliding = full = layers // 2  # even layers slide
    assert (shape.sliding_layers, shape.sliding_window) == (sliding, window)
    per_layer = 2 * kv_heads * head_dim * 2  # keys and values, bf16: 2,048 bytes a token
    assert kv_bytes_per_token(shape) == layers * per_layer  # 73,728 (120b), 49,152 (20b)
    # A runtime holding exactly its tokens: every token in the full layers, the last 128 in the sliding ones.
    assert kv_cache_bytes(shape, 32768) == per_layer * (full * 32768 + sliding * window)
    # vLLM on an H100 (16-token pages, 8,192 tokens a step, 2 steps in flight): as many sliding as full layers, so
    # one group of each, of all of them; a sliding group admits cdiv(min(127 + 16,384, T), 16) + 1 blocks.
    in_flight = 2 * 8192
    for tp in (1, 2, 8):
        paged = paged_kv_cache(shape, block_size=16, in_flight_tokens=in_flight, tp=tp)
        page = 16 * (kv_heads // tp) * (head_dim + head_dim) * 2
        assert (paged.page_bytes, paged.group_size, paged.full_groups, paged.sliding_groups) == (page, full, 1, 1)
        for tokens in (1000, 131072):
            held = min(window - 1 + in_flight, tokens)
            blocks = -(-tokens // 16) + (-(-held // 16) + 1)
            assert paged.bytes(tokens) == blocks * full * page
