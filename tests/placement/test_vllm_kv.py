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

from eval.runtimes.environments import find
from eval.runtimes.vllm_runtime import (
    CPU_IN_FLIGHT_TOKENS,
    KV_CACHE_BYTES,
    WorkerError,
    WorkerProcess,
    kv_cache_reservation,
)
from formats.architectures.shape import ModelShape
from placement.model import (
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
    # make_model writes 512 positions; vLLM refuses a max_model_len past the config's.
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_position_embeddings": 8192}))
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
    worker.request(request)
    try:
        vllm = worker.request({"op": "kv_cache"})[0]
    finally:
        worker.request({"op": "unload"})
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text())).record()
    element = ELEMENT[dtype]

    # vLLM's own defaults and budget on the CPU: the page kiln assumes there, the in-flight tokens it reported.
    assert vllm["block_size"] == (block_size or VLLM_CPU_BLOCK_SIZE) and vllm_defaults("cpu", 64).block_size == 128
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
    assert kinds.count("FullAttentionSpec") == paged.full_groups
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
