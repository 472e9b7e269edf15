"""The JAX forward's programs, one decoder layer per call (pure functions, traced once per padded shape and
`LayerConfig`): a layer over a window from position 0 on an empty cache (`PREFILL`), a layer over new tokens at a
traced position on a filled cache (`DECODE`), the final norm (`NORM`) and a block of the output head (`HEAD`).

A layer's tensors are read by their role (`attn_q`, `ffn_gate_exps`, `attn_q.bias`, `ffn_up_exps.scale`), as
`targets.orbax.layout.CheckpointTensor.key` names them; its attention is `eval.runtimes.jax_attention`'s, its MLP
`eval.runtimes.jax_mixture`'s.
"""

from __future__ import annotations

from typing import Any

from kiln.eval.runtimes.jax_attention import attention, empty_cache
from kiln.eval.runtimes.jax_mixture import mlp, moe
from kiln.eval.runtimes.jax_ops import ComputeDtype, arithmetic, rms_norm

# The layer's norms by role (`formats.architectures.record.TensorKind`).
_ATTN_NORM, _FFN_NORM = "attn_norm", "ffn_norm"
_ATTN_POST_NORM, _FFN_POST_NORM = "attn_post_norm", "ffn_post_norm"


def _layer(
    params: dict[str, Any],
    x: Any,
    start: Any,
    cache: tuple[Any, Any],
    *,
    cfg: Any,
    layer: Any,
    dtype: Any,
    precision: Any,
) -> tuple[Any, tuple[Any, Any]]:
    """One decoder layer over hidden states `x` [T, hidden] at positions start..start+T-1, and its cache
    (`jax_attention.empty_cache`) with them written; a query attends to the cached positions up to its own (within
    the layer's sliding window, if any). `layer` is what this layer's computation has of its own (`LayerConfig`:
    window, rope, experts)."""
    import jax.numpy as jnp

    t, s = x.shape[0], cache[0].shape[0]
    positions = start + jnp.arange(t, dtype=jnp.int32)
    keys_at = jnp.arange(s, dtype=jnp.int32)
    visible = keys_at[None, :] <= positions[:, None]
    if layer.window is not None:
        visible &= positions[:, None] - keys_at[None, :] < layer.window

    def norm(v: Any, kind: str) -> Any:
        return rms_norm(v, params[kind], cfg.shape.rms_norm_eps, cfg.norm_offset, dtype)

    attn, cache = attention(
        params,
        norm(x, _ATTN_NORM),
        positions,
        start,
        cache,
        visible,
        cfg=cfg,
        layer=layer,
        dtype=dtype,
        precision=precision,
    )
    if cfg.sandwich_norms:
        attn = norm(attn, _ATTN_POST_NORM)
    x = x + attn
    h = norm(x, _FFN_NORM)
    out = (moe if layer.sparse else mlp)(params, h, cfg=cfg, dtype=dtype, precision=precision)
    if cfg.sandwich_norms:
        out = norm(out, _FFN_POST_NORM)
    return x + out, cache


def _prefill(
    params: dict[str, Any], x: Any, *, cfg: Any, layer: Any, compute_dtype: ComputeDtype
) -> tuple[Any, tuple[Any, Any]]:
    """One layer over `x` from position 0, on an empty cache of as many positions."""
    dtype, precision = arithmetic(compute_dtype)
    cache = empty_cache(cfg, x.shape[0], dtype)
    return _layer(params, x, 0, cache, cfg=cfg, layer=layer, dtype=dtype, precision=precision)


def _decode(
    params: dict[str, Any],
    x: Any,
    start: Any,
    cache: tuple[Any, Any],
    *,
    cfg: Any,
    layer: Any,
    compute_dtype: ComputeDtype,
) -> tuple[Any, tuple[Any, Any]]:
    """One layer over `x` at positions from `start` (traced: one program serves every step)."""
    dtype, precision = arithmetic(compute_dtype)
    return _layer(params, x, start, cache, cfg=cfg, layer=layer, dtype=dtype, precision=precision)


def _norm(x: Any, weight: Any, *, cfg: Any, compute_dtype: ComputeDtype) -> Any:
    """The final RMSNorm."""
    dtype, _ = arithmetic(compute_dtype)
    return rms_norm(x, weight, cfg.shape.rms_norm_eps, cfg.norm_offset, dtype)


def _head_block(h: Any, block: Any, *, compute_dtype: ComputeDtype, softcap: float | None) -> Any:
    """Logits [T, rows] (float32) of a block of the output head's vocabulary rows, soft-capped to (-cap, cap) as
    cap * tanh(logits / cap) where the model caps them (Gemma's final_logit_softcapping)."""
    import jax.numpy as jnp

    dtype, precision = arithmetic(compute_dtype)
    logits = jnp.einsum("th,vh->tv", h, block.astype(dtype), precision=precision).astype(jnp.float32)
    return logits if softcap is None else jnp.tanh(logits / softcap) * softcap


class _Jitted:
    """`jax.jit(fn)` made on first use (importing jax is not free); shared by every runtime in the process, so
    artifacts of the same config, dtypes and shapes reuse one another's compiled programs (every layer of a
    model shares one)."""

    def __init__(self, fn: Any, static: tuple[str, ...] = ("cfg", "compute_dtype")) -> None:
        self._fn = fn
        self._static = static
        self._jitted: Any = None

    def __call__(self, *args: Any, **static: Any) -> Any:
        if self._jitted is None:
            import jax

            self._jitted = jax.jit(self._fn, static_argnames=self._static)
        return self._jitted(*args, **static)


PREFILL = _Jitted(_prefill, ("cfg", "layer", "compute_dtype"))
DECODE = _Jitted(_decode, ("cfg", "layer", "compute_dtype"))
NORM = _Jitted(_norm)
HEAD = _Jitted(_head_block, ("compute_dtype", "softcap"))
