"""The JAX forward's primitives (`eval.runtimes.jax_forward`): Linear layers over `[out, in]` weights (int8 ones
dequantized inside the program), RMSNorm, the gated activations, and the arithmetic of a compute dtype."""

from __future__ import annotations

from typing import Any, Literal

ComputeDtype = Literal["float32", "bfloat16"]


def arithmetic(compute_dtype: ComputeDtype) -> tuple[Any, Any]:
    """(dtype, matmul precision) of `compute_dtype`: float32 at HIGHEST, which TPUs otherwise round to bf16."""
    import jax

    precision = jax.lax.Precision.HIGHEST if compute_dtype == "float32" else jax.lax.Precision.DEFAULT
    return jax.numpy.dtype(compute_dtype), precision


def linear(params: dict[str, Any], kind: str, x: Any, dtype: Any, precision: Any) -> Any:
    """x @ W^T (+ bias) of the layer's Linear of role `kind`; an int8 weight's per-output-channel scale applied after
    the matmul: x @ (q * s)^T == (x @ q^T) * s, the form weight-only int8 kernels use."""
    import jax.numpy as jnp

    w = params[kind]
    y = jnp.einsum("...i,oi->...o", x, w.astype(dtype), precision=precision)
    scale = params.get(kind + ".scale")
    if scale is not None:
        y = y * scale.astype(dtype)
    bias = params.get(kind + ".bias")
    if bias is not None:
        y = y + bias.astype(dtype)
    return y


def rms_norm(x: Any, weight: Any, eps: float, offset: float, dtype: Any) -> Any:
    """RMSNorm over the last axis in float32, scaled by (offset + w): Gemma's norms store w around 0 (offset 1)."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return ((offset + weight.astype(jnp.float32)) * normed).astype(dtype)


def activation(name: str, x: Any) -> Any:
    import jax

    return jax.nn.silu(x) if name == "silu" else jax.nn.gelu(x, approximate=True)


def clamped_swiglu(gate: Any, up: Any, limit: float, alpha: float) -> Any:
    """gpt-oss's experts (transformers' GptOssExperts._apply_gate): the gate clamped to at most `limit`, up to
    [-limit, limit], then gate · sigmoid(alpha · gate) · (up + 1)."""
    import jax
    import jax.numpy as jnp

    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
