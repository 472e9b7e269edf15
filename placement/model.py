"""A model's arithmetic, over its `core.shape.ShapeRecord`: parameters total and active, the experts a decode
step touches, KV-cache bytes and the tensor-parallel degrees its heads split over. Pure functions; the
pipeline's stage requirements, resolve's replica plans and the routing renderer all count with these.

Notation: L layers (L_s sparse, L_w sliding), h hidden, f a dense MLP's width, q = heads × head_dim,
kv = KV heads × head_dim, V vocabulary, E experts of width f_e, k per token, f_s a shared expert's width.

- Parameters per layer: attention h·q + 2·h·kv + q·h, two norms 2·h; a dense MLP 3·h·f; a sparse one the
  router E·h and E experts of 3·h·f_e, a shared expert 3·h·f_s. Embeddings V·h, and the head V·h unless tied.
  (Biases and q/k norms, where a family has them, are under 0.01 % and not counted.)
- Active parameters (what one token computes with): all of them but the routed experts it does not run:
  each sparse layer's router, k experts and the shared expert besides the rest. A decode step at batch B
  reads each sparse layer's distinct experts, E·(1 − (1 − k/E)^B) of them in expectation for independent
  tokens, not B·k.
- KV cache per token of a sequence of T tokens: 2·kv·(bytes per element) for each full layer, and for each
  sliding layer only while T is within its window: the cache of T tokens is 2·kv·e·(L_full·T + L_w·min(T, W)).
"""

from __future__ import annotations

from core.shape import ShapeRecord, kv_element_bytes


def _attention(s: ShapeRecord) -> int | None:
    heads, h = s.num_attention_heads, s.hidden_size
    if heads is None or h is None:
        return None
    q, kv = heads * s.head_dim, s.num_kv_heads * s.head_dim
    return h * q + 2 * h * kv + q * h + 2 * h


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
    sliding = 0
    if s.sliding_window is not None:
        sliding = min(s.sliding_layers, s.num_layers) if s.sliding_layers is not None else s.num_layers
    return (s.num_layers - sliding) * tokens + sliding * min(tokens, s.sliding_window or tokens)


def kv_heads_per_device(s: ShapeRecord, tp: int = 1) -> int:
    """The KV heads each of `tp` devices keeps: its share, or one replicated head where tp > KV heads."""
    return max(s.num_kv_heads // tp, 1)


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
    per_token_layer = 2 * kv_heads_per_device(s, tp) * s.head_dim * element
    return per_token_layer * kv_layer_tokens(s, tokens) * concurrency


def kv_bytes_per_token(s: ShapeRecord, kv_dtype: str = "bf16") -> int:
    """One token's keys and values over every layer (the sliding layers' included: a token within the window)."""
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * kv_element_bytes(kv_dtype)


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
