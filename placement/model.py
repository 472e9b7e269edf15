"""A model's arithmetic, over its `core.shape.ShapeRecord`: parameters total and active, the experts a decode
step touches, KV-cache bytes and the tensor-parallel degrees its heads split over. Pure functions; the
pipeline's stage requirements, resolve's replica plans and the routing renderer all count with these.

Notation: L layers (L_s sparse, L_w sliding), h hidden, f a dense MLP's width, q = heads × head_dim,
kv = KV heads × head_dim, V vocabulary, E experts of width f_e, k per token, f_s a shared expert's width.

- Parameters per layer: attention h·q + 2·h·kv + q·h, two norms 2·h; a dense MLP 3·h·f; a sparse one the
  router E·h and E experts of 3·h·f_e, a shared expert 3·h·f_s. Embeddings V·h, and the head V·h unless tied.
  (Biases, sinks and q/k norms, where a family has them, are not counted: under 0.01 %, gpt-oss's expert biases
  0.03 %.) Multi-head latent attention (H heads, query latent r_q, KV latent r_kv, rope key d_r, each head's
  query and key d_qk = d_nope + d_r, value d_v): h·r_q + r_q + r_q·H·d_qk (or h·H·d_qk without a query latent),
  h·(r_kv + d_r) + r_kv, r_kv·H·(d_nope + d_v), H·d_v·h, and the two norms.
- Active parameters (what one token computes with): all of them but the routed experts it does not run:
  each sparse layer's router, k experts and the shared expert besides the rest. A decode step at batch B
  reads each sparse layer's distinct experts, E·(1 − (1 − k/E)^B) of them in expectation for independent
  tokens, not B·k.
- KV cache per token of a sequence of T tokens: 2·kv·(bytes per element) for each full layer, and for each
  sliding layer only while T is within its window: the cache of T tokens is 2·kv·e·(L_full·T + L_w·min(T, W)),
  what a runtime holding exactly its tokens keeps (llama.cpp, the JAX forward).
- Multi-head latent attention caches one latent per token and layer, r_kv + d_r elements (DeepSeek-V3: 512 + 64),
  not 2·kv: vLLM 0.32's `MLAAttention.get_kv_cache_spec` (model_executor/layers/attention/mla_attention.py) gives
  every MLA layer one KV head of `head_size = kv_lora_rank + qk_rope_head_dim` and no separate value
  (`MLAAttentionSpec.head_size_v = 0`, v1/kv_cache_interface.py: a page is block_size × head_size × e bytes), with
  `max_tp_shards=1`: every tensor-parallel rank holds the whole latent. transformers' cache and llama.cpp's MLA
  keep the same latent.
- vLLM pages it (`PagedKvCache`, its accounting as vLLM 0.32 does it, checked against vLLM's own figures by
  tests/placement/test_vllm_kv.py): pages of b tokens (16; 128 on the CPU) of one layer, 2·kv·e·b bytes each; the
  layers in groups that share a block table (one group of every layer, or for full and sliding layers mixed,
  groups of g layers each: g the fewer layers of one kind, or the more where those are under 1.5 times as many,
  the last group of a kind padded); a block of the pool holds one page of each of g layers. A sequence of T
  tokens takes ⌈T/b⌉ blocks in each full group, and in each sliding group ⌈min(W − 1 + F, T)/b⌉ + 1 (its window,
  the F tokens of the steps in flight, and a block the window may straddle). Of M bytes the pool has
  ⌊M/(g·2·kv·e·b)⌋ blocks; its capacity, as vLLM reports it, is blocks ÷ (blocks of one sequence of the longest
  length) × that length, in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.shape import ShapeRecord, kv_element_bytes


def _attention(s: ShapeRecord) -> int | None:
    heads, h = s.num_attention_heads, s.hidden_size
    if heads is None or h is None:
        return None
    if s.is_mla:
        return _latent_attention(s, heads, h)
    q, kv = heads * s.head_dim, s.num_kv_heads * s.head_dim
    return h * q + 2 * h * kv + q * h + 2 * h


def _latent_attention(s: ShapeRecord, heads: int, h: int) -> int | None:
    """Multi-head latent attention's parameters and the layer's two norms (the module's notation)."""
    r_kv, d_r, d_v, r_q = s.kv_lora_rank, s.qk_rope_head_dim, s.v_head_dim, s.q_lora_rank
    if r_kv is None or d_r is None or d_v is None:
        return None
    d_qk = s.head_dim
    query = h * r_q + r_q + r_q * heads * d_qk if r_q is not None else h * heads * d_qk
    latent = h * (r_kv + d_r) + r_kv + r_kv * heads * (d_qk - d_r + d_v)
    return query + latent + heads * d_v * h + 2 * h


def sparse_layers(s: ShapeRecord) -> int:
    """How many layers route to experts (0 for a dense model)."""
    if not s.is_moe:
        return 0
    return min(s.sparse_layers, s.num_layers) if s.sparse_layers is not None else s.num_layers


def expert_parameters(s: ShapeRecord) -> int | None:
    """One routed expert's parameters (gate, up and down)."""
    width = s.moe_intermediate_size or s.intermediate_size
    return 3 * s.hidden_size * width if s.is_moe and width is not None and s.hidden_size is not None else None


def _layer_parts(s: ShapeRecord) -> tuple[int, int, int, int, int] | None:
    """(attention + norms per layer, a dense MLP, a sparse layer's router + shared expert, one expert, embedding)."""
    attention, h, ff, vocab = _attention(s), s.hidden_size, s.intermediate_size, s.vocab_size
    if attention is None or h is None or vocab is None:
        return None
    dense = 3 * h * ff if ff is not None else None
    if dense is None and sparse_layers(s) < s.num_layers:
        return None
    expert = expert_parameters(s) or 0
    if s.is_moe and not expert:
        return None
    fixed = (s.num_experts or 0) * h + 3 * h * (s.shared_expert_intermediate_size or 0) if s.is_moe else 0
    return attention, dense or 0, fixed, expert, vocab * h


def parameters(s: ShapeRecord) -> int | None:
    """Every parameter: each layer's attention, its dense MLP or all its experts, the final norm, embeddings
    and the head unless tied. None when hidden, heads, the MLP's width or the vocabulary are unknown."""
    parts = _layer_parts(s)
    if parts is None:
        return None
    attention, dense, fixed, expert, embedding = parts
    sparse = sparse_layers(s)
    mlps = (s.num_layers - sparse) * dense + sparse * (fixed + (s.num_experts or 0) * expert)
    return s.num_layers * attention + mlps + s.hidden_size + embedding * (1 if s.tie_word_embeddings else 2)  # type: ignore[operator]


def experts_touched(s: ShapeRecord, batch: int) -> float:
    """The expected distinct experts one sparse layer runs for `batch` tokens routed independently:
    E·(1 − (1 − k/E)^B) (k at batch 1, E as B grows)."""
    if not s.is_moe:
        return 0.0
    e, k = float(s.num_experts or 0), float(s.experts_per_token or 0)
    return e * (1.0 - (1.0 - k / e) ** max(batch, 1))


def active_parameters(s: ShapeRecord, batch: int = 1) -> int | None:
    """The parameters a decode step of `batch` sequences reads: every parameter but the routed experts its tokens
    do not touch (`experts_touched` of them in each sparse layer run). At batch 1 that is what one token
    computes with (k experts a layer); a dense model's are all of them, as `parameters` counts them."""
    total, expert = parameters(s), expert_parameters(s)
    if total is None or not s.is_moe or expert is None:
        return total
    idle = (float(s.num_experts or 0) - experts_touched(s, batch)) * expert
    return round(total - sparse_layers(s) * idle)


def flops_parameters(s: ShapeRecord) -> int | None:
    """The parameters each token's matmuls use (2 FLOPs each): the active ones at batch 1 (k experts a layer)."""
    return active_parameters(s, 1)


def kv_layer_tokens(s: ShapeRecord, tokens: int) -> int:
    """Σ over layers of the tokens each keeps for a sequence of `tokens`: every full layer all of them, a
    sliding layer at most its window."""
    sliding = sliding_layer_count(s)
    return (s.num_layers - sliding) * tokens + sliding * min(tokens, s.sliding_window or tokens)


def kv_heads_per_device(s: ShapeRecord, tp: int = 1) -> int:
    """The KV heads each of `tp` devices keeps: its share, or one replicated head where tp > KV heads."""
    return max(s.num_kv_heads // tp, 1)


def kv_elements_per_token_layer(s: ShapeRecord, tp: int = 1) -> int:
    """The cache elements one token keeps in one layer on one of `tp` devices: its keys and values, 2 × the KV heads
    each device keeps × head_dim; multi-head latent attention's latent and rope key, kv_lora_rank +
    qk_rope_head_dim, whole on every device."""
    if s.is_mla:
        return s.kv_lora_rank + s.qk_rope_head_dim  # type: ignore[operator]
    return 2 * kv_heads_per_device(s, tp) * s.head_dim


def kv_cache_bytes(
    s: ShapeRecord,
    tokens: int,
    concurrency: int = 1,
    kv_dtype: str = "bf16",
    tp: int = 1,
    *,
    element_bytes: int | None = None,
) -> int:
    """Keys and values of every layer for `concurrency` sequences of `tokens` each, on one of `tp` devices, in
    `kv_dtype` (or `element_bytes` per element: a runtime's float32 cache)."""
    element = element_bytes if element_bytes is not None else kv_element_bytes(kv_dtype)
    per_token_layer = kv_elements_per_token_layer(s, tp) * element
    return per_token_layer * kv_layer_tokens(s, tokens) * concurrency


def kv_bytes_per_token(s: ShapeRecord, kv_dtype: str = "bf16", tp: int = 1, *, element_bytes: int | None = None) -> int:
    """One token's keys and values over every layer (the sliding layers' included: a token within the window), on
    one of `tp` devices, in `kv_dtype` (or `element_bytes` per element)."""
    element = element_bytes if element_bytes is not None else kv_element_bytes(kv_dtype)
    return s.num_layers * kv_elements_per_token_layer(s, tp) * element


def sliding_layer_count(s: ShapeRecord) -> int:
    """How many layers keep only a window of tokens (0 without a window)."""
    if s.sliding_window is None:
        return 0
    return min(s.sliding_layers, s.num_layers) if s.sliding_layers is not None else s.num_layers


# vLLM 0.32's defaults that shape its paged KV cache, as its source sets them: the tokens of a page
# (config/cache.py `CacheConfig.DEFAULT_BLOCK_SIZE` 16; platforms/cpu.py 128), the scheduler's tokens per step for
# `vllm serve` (engine/arg_utils.py: 16,384 on GPUs of 160 GiB or more, 8,192 on those of 70 GiB or more but the
# A100, 2,048 on the others and on CPUs; TPU v6e 1,024, v5e 512, v5p 256) and the steps in flight at once
# (config/vllm.py `max_concurrent_batches`: 2 under async scheduling, its default on GPUs; platforms/cpu.py turns
# it off).
VLLM_BLOCK_SIZE = 16
VLLM_CPU_BLOCK_SIZE = 128
# MLA on the CPU: platforms/cpu.py sets every MLA model's block size to 16 whatever was asked (the CPU MLA decode
# kernel, csrc/cpu/mla_decode.cpp, compiles for 16 only), but where its AMX MLA backend runs (an x86 CPU with AMX:
# bfloat16 only, 128-token pages). kiln's CPU eval asks for the reference backend on every CPU (`vllm_worker`).
VLLM_CPU_MLA_BLOCK_SIZE = 16
VLLM_TPU_BATCHED_TOKENS = {"v6e": 1024, "v5e": 512, "v5p": 256}
# The blocks vLLM's block pool keeps back for itself (v1/core/block_pool.py, its null block), which its memory
# check reserves before it admits a sequence (v1/core/kv_cache_utils.py `check_enough_kv_cache_memory`).
NULL_BLOCKS = 1


@dataclass(frozen=True)
class VllmDefaults:
    """What vLLM serves a model with on a device, as far as its KV cache's shape goes."""

    block_size: int  # tokens per page
    max_num_batched_tokens: int  # the scheduler's tokens per step
    concurrent_batches: int  # steps in flight at once

    @property
    def in_flight_tokens(self) -> int:
        """vLLM's `max_in_flight_tokens`: tokens scheduled but not yet settled, which a sliding layer keeps too."""
        return self.max_num_batched_tokens * self.concurrent_batches


def vllm_defaults(family: str, memory_gib: float, name: str = "", *, mla: bool = False) -> VllmDefaults:
    """`vllm serve`'s defaults on a device of `family` (cuda, rocm, tpu, cpu) with `memory_gib` per device, for a
    model with multi-head latent attention where `mla` (its own page on the CPU)."""
    if family in ("cuda", "rocm"):
        batched = 16384 if memory_gib >= 160 else 8192 if memory_gib >= 70 and "a100" not in name.lower() else 2048
        return VllmDefaults(VLLM_BLOCK_SIZE, batched, 2)
    if family == "tpu":
        batched = next((n for chip, n in VLLM_TPU_BATCHED_TOKENS.items() if chip in name.lower()), 2048)
        return VllmDefaults(VLLM_BLOCK_SIZE, batched, 1)
    return VllmDefaults(VLLM_CPU_MLA_BLOCK_SIZE if mla else VLLM_CPU_BLOCK_SIZE, 2048, 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PagedKvCache:
    """A model's KV cache as vLLM pages it on one device (see the module's notation): `page_bytes` per layer and
    page of `block_size` tokens, `group_size` layers per KV cache group, `full_groups` and `sliding_groups` of them
    (a sliding group's layers keep `sliding_window` tokens and the `in_flight_tokens` of the steps in flight)."""

    block_size: int
    page_bytes: int
    group_size: int
    full_groups: int
    sliding_groups: int
    sliding_window: int | None
    in_flight_tokens: int

    @property
    def block_bytes(self) -> int:
        """One block of the pool: a page of each layer of a group."""
        return self.group_size * self.page_bytes

    def blocks(self, memory_bytes: int) -> int:
        """The blocks a pool of `memory_bytes` holds (vLLM's `num_blocks`)."""
        return memory_bytes // self.block_bytes

    def blocks_per_sequence(self, tokens: int) -> int:
        """The blocks one sequence of `tokens` takes at most, over every group."""
        full = self.full_groups * _cdiv(tokens, self.block_size)
        if not self.sliding_groups or self.sliding_window is None:
            return full
        held = min(self.sliding_window - 1 + self.in_flight_tokens, tokens)
        return full + self.sliding_groups * (_cdiv(held, self.block_size) + 1)

    def bytes(self, tokens: int, concurrency: int = 1) -> int:
        """The pages `concurrency` sequences of `tokens` each take (vLLM's pool holds one block more, which its
        block pool keeps back: `NULL_BLOCKS`)."""
        return concurrency * self.blocks_per_sequence(tokens) * self.block_bytes

    def max_concurrency(self, memory_bytes: int, max_model_len: int) -> float:
        """How many sequences of `max_model_len` a pool of `memory_bytes` holds at once (vLLM's figure)."""
        return self.blocks(memory_bytes) / self.blocks_per_sequence(max_model_len)

    def capacity_tokens(self, memory_bytes: int, max_model_len: int) -> int:
        """The tokens a pool of `memory_bytes` holds, as vLLM reports its KV cache size: sequences of
        `max_model_len` at once × `max_model_len` (so the sliding layers' cap counts at that length)."""
        return int(self.max_concurrency(memory_bytes, max_model_len) * max_model_len)


def paged_kv_cache(
    s: ShapeRecord,
    *,
    block_size: int = VLLM_BLOCK_SIZE,
    in_flight_tokens: int = 0,
    kv_dtype: str = "bf16",
    tp: int = 1,
    element_bytes: int | None = None,
) -> PagedKvCache:
    """How vLLM pages `s`'s KV cache on one of `tp` devices (vllm/v1/core/kv_cache_utils.py
    `_get_kv_cache_groups_uniform_page_size`): every layer one group when all are of one kind; full and sliding
    layers mixed, groups of the fewer kind's count (the larger where under 1.5 times it), each kind's last group
    padded."""
    element = element_bytes if element_bytes is not None else kv_element_bytes(kv_dtype)
    page = kv_elements_per_token_layer(s, tp) * element * block_size
    sliding = sliding_layer_count(s)
    full = s.num_layers - sliding
    if not sliding or not full:
        return PagedKvCache(
            block_size, page, s.num_layers, int(full > 0), int(sliding > 0), s.sliding_window, in_flight_tokens
        )
    fewer, more = min(full, sliding), max(full, sliding)
    group = more if more < fewer * 1.5 else fewer
    return PagedKvCache(
        block_size, page, group, _cdiv(full, group), _cdiv(sliding, group), s.sliding_window, in_flight_tokens
    )


def tp_degrees(s: ShapeRecord | None, limit: int) -> tuple[list[int], list[int]]:
    """(allowed, excluded): the powers of two up to `limit`, split by whether the attention heads divide over
    them and the KV heads do or replicate evenly (tp a multiple of them). An unknown shape allows every one."""
    allowed: list[int] = []
    excluded: list[int] = []
    tp = 1
    while tp <= limit:
        ok = s is None or (
            (s.num_attention_heads is None or s.num_attention_heads % tp == 0)
            and (s.num_kv_heads % tp == 0 or tp % s.num_kv_heads == 0)
        )
        (allowed if ok else excluded).append(tp)
        tp *= 2
    return allowed, excluded
