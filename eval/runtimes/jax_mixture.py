"""The JAX forward's MLPs (`eval.runtimes.jax_forward`): the gated MLP, and a mixture of experts as transformers 5.17
computes each router the orbax layout maps (`targets.orbax.forward.ForwardConfig.router`):

- `softmax_topk` (Qwen3-MoE, Mixtral): a softmax over every expert's logit (float32), the top k kept, renormalised
  to sum to 1 where `norm_topk_prob`;
- `topk_softmax` (gpt-oss's GptOssTopKRouter): the top k logits (the router's bias added), then a softmax over them;
- `sigmoid_groups` (DeepSeek-V3's DeepseekV3MoE.route_tokens_to_experts): sigmoid scores of float32 logits; for the
  choice only, the correction bias added, the experts' `expert_groups` groups ranked by the sum of their two best,
  the best `topk_groups` kept (the others' experts scored -inf), the top k of those; the chosen experts weighted by
  their uncorrected scores, renormalised (over the sum plus 1e-20) where `norm_topk_prob`, times
  `routed_scaling_factor`.

Each chosen expert's output (SwiGLU, or gpt-oss's clamped SwiGLU, with the experts' biases where stored) is weighted
and summed; shared experts (DeepSeek-V3) run on every token beside them, an MLP of their own.

Computed densely: every expert runs on every token and the experts not chosen weigh 0, so one program with no
data-dependent shapes serves every call, and a mesh that splits the expert axis reduces the weighted sum over it.
That costs experts / k times the routed FLOPs and holds [tokens, experts, moe_intermediate] activations: right for
an evaluation's few thousand tokens, not for serving (which gathers each expert's tokens).
"""

from __future__ import annotations

from typing import Any

from kiln.eval.runtimes.jax_ops import activation, clamped_swiglu, linear


def mlp(params: dict[str, Any], h: Any, *, cfg: Any, dtype: Any, precision: Any, shared: bool = False) -> Any:
    """The gated MLP down(act(gate(h)) * up(h)); `shared`: the shared experts' (`ffn_*_shexp`)."""
    gate, up, down = (
        ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp") if shared else ("ffn_gate", "ffn_up", "ffn_down")
    )
    product = activation(cfg.activation, linear(params, gate, h, dtype, precision)) * linear(
        params, up, h, dtype, precision
    )
    return linear(params, down, product, dtype, precision)


def _experts(params: dict[str, Any], kind: str, spec: str, x: Any, dtype: Any, precision: Any) -> Any:
    """Every expert's Linear of `kind` ([experts, out, in], int8 scales and biases [experts, out]) by einsum `spec`."""
    import jax.numpy as jnp

    y = jnp.einsum(spec, x, params[kind].astype(dtype), precision=precision)
    scale = params.get(kind + ".scale")
    if scale is not None:
        y = y * scale.astype(dtype)[None]
    bias = params.get(kind + ".bias")
    return y if bias is None else y + bias.astype(dtype)[None]


def _route(params: dict[str, Any], h: Any, cfg: Any, dtype: Any, precision: Any) -> Any:
    """[tokens, experts] float32: each chosen expert's weight, 0 for the others."""
    import jax
    import jax.numpy as jnp

    router = params["ffn_gate_inp"]
    if cfg.router == "sigmoid_groups":  # transformers computes this router's logits in float32
        logits = jnp.einsum("th,eh->te", h.astype(jnp.float32), router.astype(jnp.float32), precision=precision)
    else:
        logits = linear(params, "ffn_gate_inp", h, dtype, precision)
    logits = logits.astype(jnp.float32)
    k = cfg.experts_per_token
    if cfg.router == "softmax_topk":
        top, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if cfg.norm_topk_prob:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
    elif cfg.router == "topk_softmax":
        top, chosen = jax.lax.top_k(logits, k)
        top = jax.nn.softmax(top, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores + params["exp_probs_b"].astype(jnp.float32)[None]
        t, groups = h.shape[0], cfg.expert_groups
        grouped = choice.reshape(t, groups, cfg.experts // groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, best = jax.lax.top_k(group_scores, cfg.topk_groups)
        kept = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.float32), axis=1) > 0  # [t, groups]
        masked = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, cfg.experts)
        _, chosen = jax.lax.top_k(masked, k)
        top = jnp.take_along_axis(scores, chosen, axis=-1)
        if cfg.norm_topk_prob:
            top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
        top = top * cfg.routed_scaling_factor
    # One-hot rows of k distinct experts: the weighted sum puts each weight in its expert's column exactly.
    return jnp.einsum("tk,tke->te", top, jax.nn.one_hot(chosen, cfg.experts, dtype=jnp.float32))


def moe(params: dict[str, Any], h: Any, *, cfg: Any, dtype: Any, precision: Any) -> Any:
    """A sparse layer's MLP: the routed experts' weighted sum (computed densely), plus the shared experts' MLP."""
    import jax.numpy as jnp

    weights = _route(params, h, cfg, dtype, precision).astype(dtype)
    gate = _experts(params, "ffn_gate_exps", "th,efh->tef", h, dtype, precision)
    up = _experts(params, "ffn_up_exps", "th,efh->tef", h, dtype, precision)
    if cfg.swiglu_limit is not None:
        product = clamped_swiglu(gate, up, cfg.swiglu_limit, cfg.swiglu_alpha)
    else:
        product = activation(cfg.activation, gate) * up
    out = _experts(params, "ffn_down_exps", "tef,ehf->teh", product, dtype, precision)
    routed = jnp.einsum("te,teh->th", weights, out, precision=precision)
    if cfg.shared_experts:
        routed = routed + mlp(params, h, cfg=cfg, dtype=dtype, precision=precision, shared=True)
    return routed
