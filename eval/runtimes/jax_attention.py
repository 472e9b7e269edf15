"""The JAX forward's attention (`eval.runtimes.jax_forward`), as transformers 5.17 computes each kind the orbax
layout maps (`targets.orbax.forward.ForwardConfig`):

- grouped-query attention: q/k/v projections (with their biases where stored), per-head q/k RMSNorm before rope
  (Qwen3, Gemma 3), rope, a causal mask with the layer's sliding window, and per-head sinks where the model has them
  (gpt-oss: one learned logit per head joins each row's softmax and is dropped after it, so a row may attend to
  nothing); the cache holds every position's keys and values, [S, kv_heads, head_dim] each;
- multi-head latent attention (DeepSeek-V3's `DeepseekV3Attention`), in its non-absorbed form: queries through the
  q_a latent, its RMSNorm and q_b (or one q_proj); the compressed key-value latent (kv_a_proj_with_mqa's first
  kv_lora_rank outputs) RMSNormed, and one rope key every head shares (its last qk_rope_head_dim); the cache holds
  those two, [S, kv_lora_rank] and [S, qk_rope_head_dim], as an MLA serving stack does, and kv_b_proj expands the
  cached latents to every head's no-rope key and value on each call (the absorbed form, which folds kv_b into the
  query and the output projection instead, computes the same product in another order and is not used). The rope
  rotates interleaved pairs where `rope_interleave` (transformers' `apply_rotary_pos_emb_interleave`: the pairs
  gathered to halves, then the usual rotation).

Rope: transformers' default frequencies, linear scaling (divided by the factor), or YaRN's blend with cos and sin
times its attention factor (`_compute_yarn_parameters`), all in float32 as transformers computes them.
"""

from __future__ import annotations

from typing import Any

from kiln.eval.runtimes.jax_ops import linear, rms_norm


def inv_freq(rotary_dim: int, layer: Any) -> Any:
    """[rotary_dim / 2] float32 rope frequencies of a layer (`LayerConfig`: its base, linear factor or YaRN)."""
    import jax.numpy as jnp

    d = rotary_dim
    pos_freqs = layer.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    yarn = layer.yarn
    if yarn is None:
        out = 1.0 / pos_freqs
        return out / layer.rope_factor if layer.rope_factor != 1.0 else out
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    high = yarn.high + 0.001 if yarn.low == yarn.high else yarn.high
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - yarn.low) / (high - yarn.low), 0, 1)
    keep = 1 - ramp  # the share of each pair's own frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope(x: Any, positions: Any, rotary_dim: int, layer: Any, *, interleave: bool = False) -> Any:
    """Rotary embedding of x [T, heads, dim], transformers' layout: the two halves of the first `rotary_dim`
    dimensions of each head are rotated as (x1, x2) pairs, the rest pass through (Phi-3's partial rotary);
    `interleave`: the pairs are (x0, x1), (x2, x3), ..., gathered into halves first (the result stays in that
    order, for queries and keys alike, so their dot products are the interleaved rotation's)."""
    import jax.numpy as jnp

    d = rotary_dim
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq(d, layer)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    factor = layer.yarn.attention_factor if layer.yarn is not None else 1.0
    cos, sin = (jnp.cos(emb) * factor)[:, None, :], (jnp.sin(emb) * factor)[:, None, :]
    rot = x[..., :d]
    if interleave:
        rot = jnp.swapaxes(rot.reshape(*rot.shape[:-1], d // 2, 2), -1, -2).reshape(rot.shape)
    x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (rot.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
    return out if d == x.shape[-1] else jnp.concatenate([out, x[..., d:]], axis=-1)


def empty_cache(cfg: Any, length: int, dtype: Any) -> tuple[Any, Any]:
    """A layer's cache of `length` positions: keys and values [S, kv_heads, head_dim], or MLA's latents
    [S, kv_lora_rank] and rope keys [S, qk_rope_head_dim]."""
    import jax.numpy as jnp

    if cfg.mla is not None:
        return jnp.zeros((length, cfg.mla.kv_lora_rank), dtype), jnp.zeros((length, cfg.mla.qk_rope_head_dim), dtype)
    shape = (length, cfg.shape.num_kv_heads, cfg.shape.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def _probs(scores: Any, visible: Any, sinks: Any | None) -> Any:
    """Softmax over the keys of float32 scores [..., T, S] where `visible` [T, S]; with `sinks` [...] (one per
    head), each head's sink logit is one more column of its rows' softmax, dropped after it."""
    import jax
    import jax.numpy as jnp

    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[..., None, None], (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def attention(
    params: dict[str, Any],
    h: Any,
    positions: Any,
    start: Any,
    cache: tuple[Any, Any],
    visible: Any,
    *,
    cfg: Any,
    layer: Any,
    dtype: Any,
    precision: Any,
) -> tuple[Any, tuple[Any, Any]]:
    """The attention block's output [T, hidden] for normed hidden states `h` at `positions` (from `start`), and the
    cache with this call's positions written; a query sees the cached positions `visible` marks."""
    fn = _mla if cfg.mla is not None else _gqa
    return fn(params, h, positions, start, cache, visible, cfg=cfg, layer=layer, dtype=dtype, precision=precision)


def _gqa(
    params: dict[str, Any],
    h: Any,
    positions: Any,
    start: Any,
    cache: tuple[Any, Any],
    visible: Any,
    *,
    cfg: Any,
    layer: Any,
    dtype: Any,
    precision: Any,
) -> tuple[Any, tuple[Any, Any]]:
    import jax
    import jax.numpy as jnp

    t = h.shape[0]
    nh, nkv, hd = cfg.shape.num_heads, cfg.shape.num_kv_heads, cfg.shape.head_dim
    q = linear(params, "attn_q", h, dtype, precision).reshape(t, nh, hd)
    k = linear(params, "attn_k", h, dtype, precision).reshape(t, nkv, hd)
    v = linear(params, "attn_v", h, dtype, precision).reshape(t, nkv, hd)
    if cfg.qk_norm:  # per head, before rope
        q = rms_norm(q, params["attn_q_norm"], cfg.shape.rms_norm_eps, cfg.norm_offset, dtype)
        k = rms_norm(k, params["attn_k_norm"], cfg.shape.rms_norm_eps, cfg.norm_offset, dtype)
    q = rope(q, positions, cfg.rotary_dim, layer)
    k = rope(k, positions, cfg.rotary_dim, layer)
    ck = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (start, 0, 0))
    cv = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (start, 0, 0))
    # Grouped-query attention: query head j reads kv head j // (nh / nkv).
    g = nh // nkv
    qg = q.reshape(t, nkv, g, hd)
    scores = jnp.einsum("tkgd,skd->kgts", qg, ck, precision=precision).astype(jnp.float32) * cfg.attention_scale
    sinks = params["attn_sinks"].reshape(nkv, g) if cfg.sinks else None
    probs = _probs(scores, visible[None, None], sinks).astype(dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, cv, precision=precision).reshape(t, nh * hd)
    return linear(params, "attn_output", out, dtype, precision), (ck, cv)


def _mla(
    params: dict[str, Any],
    h: Any,
    positions: Any,
    start: Any,
    cache: tuple[Any, Any],
    visible: Any,
    *,
    cfg: Any,
    layer: Any,
    dtype: Any,
    precision: Any,
) -> tuple[Any, tuple[Any, Any]]:
    import jax
    import jax.numpy as jnp

    m = cfg.mla
    t, s, nh = h.shape[0], cache[0].shape[0], cfg.shape.num_heads
    nope, rank = m.qk_nope_head_dim, m.kv_lora_rank

    def norm(x: Any, kind: str) -> Any:
        return rms_norm(x, params[kind], cfg.shape.rms_norm_eps, cfg.norm_offset, dtype)

    if m.q_lora_rank is None:
        q = linear(params, "attn_q", h, dtype, precision)
    else:
        q = linear(
            params, "attn_q_b", norm(linear(params, "attn_q_a", h, dtype, precision), "attn_q_a_norm"), dtype, precision
        )
    q = q.reshape(t, nh, m.qk_head_dim)
    q_rot = rope(q[..., nope:], positions, cfg.rotary_dim, layer, interleave=m.rope_interleave)
    compressed = linear(params, "attn_kv_a_mqa", h, dtype, precision)
    latent = norm(compressed[:, :rank], "attn_kv_a_norm")
    k_rot = rope(compressed[:, None, rank:], positions, cfg.rotary_dim, layer, interleave=m.rope_interleave)[:, 0]
    latents = jax.lax.dynamic_update_slice(cache[0], latent.astype(cache[0].dtype), (start, 0))
    rope_keys = jax.lax.dynamic_update_slice(cache[1], k_rot.astype(cache[1].dtype), (start, 0))
    kv = linear(params, "attn_kv_b", latents, dtype, precision).reshape(s, nh, nope + m.v_head_dim)
    keys = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(rope_keys[:, None, :], (s, nh, m.qk_rope_head_dim))], -1)
    query = jnp.concatenate([q[..., :nope], q_rot], axis=-1)
    scores = jnp.einsum("thd,shd->hts", query, keys, precision=precision).astype(jnp.float32) * cfg.attention_scale
    probs = _probs(scores, visible[None], None).astype(dtype)
    out = jnp.einsum("hts,shd->thd", probs, kv[..., nope:], precision=precision).reshape(t, nh * m.v_head_dim)
    return linear(params, "attn_output", out, dtype, precision), (latents, rope_keys)
