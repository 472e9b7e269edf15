"""JAX: the runtime of the orbax target, a Llama-family forward pass written in JAX and run under `jax.jit`.

The artifact's orbax checkpoint is restored with orbax (`targets.orbax.layout` describes it): on one
device by default, or, with `mesh=True`, onto the artifact's mesh with every array placed by its
`sharding.json` partition spec (`NamedSharding`), the way a TPU slice loads it; XLA then partitions
the same jitted program over the mesh.

The device is explicit, never JAX's default backend: `device` is the stage's (`cpu`, `cuda:N`;
`pipeline.placement`), the platform whose devices the arrays are restored onto (the first N+1 for
a mesh), so with jax[cuda] installed a CPU stage still computes on the CPU and a GPU stage on its
GPU, with the same code path. The platform is recorded in `version` (and so in the eval report).

The forward is the transformers Llama/Mistral/Qwen2 computation: RMSNorm, rotary embeddings (plain
RoPE with the config's rope_theta), grouped-query attention with a causal (and, for Mistral, a
sliding-window) mask, SwiGLU MLP, tied or untied lm_head, and Qwen2's q/k/v biases. int8 weights are
dequantized inside the program: a Linear layer's weight is q * scale with one scale per output
channel, so x @ (q * scale)^T is computed as (x @ q^T) * scale, the form weight-only int8 kernels use.

`compute_dtype` is the activation dtype: float32 (default) measures the artifact's weights with as
little rounding in the arithmetic as the reference has (float32 matmuls at HIGHEST precision, which
TPUs otherwise round to bf16); bfloat16 computes as a TPU serving stack does.

Sequences are padded to power-of-two buckets (padding sits after the real tokens, which the causal
mask keeps it from influencing), so one compiled program serves every window of a bucket. `greedy`
decodes on a KV cache: one prefill (a window program: the prompt padded to the cache's length, so the
program already compiled for the eval's windows serves it), then one jitted step per token at a traced
position. The programs are jitted once per process (static: the config and the compute dtype), so
artifacts of the same shapes share their compilations; each compile costs about a second on a CPU.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from core.errors import Deferred, InvalidInput, KilnError, StageFailed
from eval.runtimes.base import check_ids, import_runtime

ComputeDtype = Literal["float32", "bfloat16"]
MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The padded length that serves `n` tokens: the next power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


class JaxRuntime:
    """An orbax artifact directory restored into JAX arrays and served by a jitted forward pass."""

    name = "jax"

    def __init__(
        self, artifact: str | Path, *, mesh: bool = False, compute_dtype: ComputeDtype = "float32", device: str = "cpu"
    ) -> None:
        # JAX takes 75% of a GPU's memory when its CUDA backend starts, by default; the torch stages that run
        # in the same process (the local executor) need theirs, so it allocates what it uses instead.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        jax, orbax_checkpoint = import_runtime(("jax", "orbax.checkpoint"), "jax")
        from targets.orbax.layout import FORMAT, FORMAT_VERSION, forward_config

        if compute_dtype not in ("float32", "bfloat16"):
            raise InvalidInput(f"compute_dtype must be float32 or bfloat16, got {compute_dtype!r}")
        self.path = Path(artifact)
        if not self.path.is_dir():
            raise InvalidInput(
                f"orbax artifact {str(self.path)!r} is not a directory", details={"path": str(self.path)}
            )
        weights, sharding, config = (self._read_json(n) for n in ("weights.json", "sharding.json", "config.json"))
        try:
            self.config = forward_config(config)
        except KilnError as e:
            raise StageFailed(
                f"the JAX forward cannot serve {str(self.path)!r}: {e.message}",
                code="EVAL_RUNTIME_LOAD_FAILED",
                details={"runtime": self.name, "path": str(self.path)},
            ) from None
        if weights.get("format") != FORMAT or weights.get("format_version") != FORMAT_VERSION:
            raise StageFailed(
                f"{str(self.path)!r} is not a {FORMAT} artifact of version {FORMAT_VERSION} "
                f"(weights.json says {weights.get('format')!r} version {weights.get('format_version')!r})",
                code="EVAL_RUNTIME_LOAD_FAILED",
                details={"runtime": self.name, "path": str(self.path)},
            )
        self.quant = str(weights.get("quant"))
        self.devices = platform_devices(device)
        self.platform = self.devices[0].platform
        try:
            self.mesh = _device_mesh(sharding["mesh"], self.devices) if mesh else None
            self.params = _restore(
                self.path / weights["checkpoint"], weights["tensors"], sharding, self.mesh, self.devices[0]
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise StageFailed(
                f"orbax artifact {str(self.path)!r}: weights.json or sharding.json is malformed ({e!r})",
                code="EVAL_RUNTIME_LOAD_FAILED",
                details={"runtime": self.name, "path": str(self.path)},
            ) from None
        self.vocab_size = self.config.vocab_size
        self.compute_dtype = compute_dtype
        self._buckets: set[int] = set()  # padded lengths whose prefill program this runtime has run
        self.version = f"jax {jax.__version__}, orbax-checkpoint {orbax_checkpoint.__version__}, on {self.platform}"

    def _read_json(self, name: str) -> dict[str, Any]:
        try:
            value = json.loads((self.path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise StageFailed(
                f"orbax artifact {str(self.path)!r}: cannot read {name}: {e}",
                code="EVAL_RUNTIME_LOAD_FAILED",
                details={"runtime": self.name, "path": str(self.path), "file": name},
            ) from None
        if not isinstance(value, dict):
            raise StageFailed(f"orbax artifact: {name} is not a JSON object", code="EVAL_RUNTIME_LOAD_FAILED")
        return value

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = check_ids(token_ids, self.vocab_size, self.name)
        padded = np.zeros(bucket(len(ids)), dtype=np.int32)
        padded[: len(ids)] = ids
        out, _ = self._run_prefill(padded)
        return np.array(out[: len(ids)], dtype=np.float32)  # a writable copy, as every runtime returns

    def _run_prefill(self, padded: np.ndarray) -> tuple[Any, Any]:
        """The window program: logits of `padded` from position 0, and a KV cache of as many positions."""
        self._buckets.add(len(padded))
        return _PREFILL(self.params, padded, cfg=self.config, compute_dtype=self.compute_dtype)

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        return [self._greedy_one(p, n) for p in prompts]

    def _greedy_one(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        ids = check_ids(prompt_ids, self.vocab_size, self.name)
        if n <= 0:
            return []
        # The prompt is padded to the cache's length, so the prefill is a window program; one this runtime
        # has already compiled (for the eval's windows) when one is long enough: an XLA compile costs ~1 s.
        needed = bucket(len(ids) + n)
        cache_len = min((b for b in self._buckets if b >= needed), default=needed)
        padded = np.zeros(cache_len, dtype=np.int32)
        padded[: len(ids)] = ids
        logits, cache = self._run_prefill(padded)
        tok = int(np.argmax(np.asarray(logits[len(ids) - 1])))
        generated = [tok]
        for i in range(1, n):
            # The token generated last goes in at the next position; its logits give the next token.
            # Its cache row overwrites the padding's (which no query at or before it could see).
            position = np.int32(len(ids) + i - 1)
            step_logits, cache = _DECODE(
                self.params,
                np.array([tok], dtype=np.int32),
                position,
                cache,
                cfg=self.config,
                compute_dtype=self.compute_dtype,
            )
            tok = int(np.argmax(np.asarray(step_logits[0])))
            generated.append(tok)
        return generated

    def close(self) -> None:
        self.params = {}


def platform_devices(device: str) -> list[Any]:
    """The JAX devices of the stage's device: `cpu` -> the CPU devices; `cuda` / `cuda:N` -> the GPUs from
    the N-th on (the first is where arrays go). DEVICE_UNAVAILABLE when this JAX has no such backend."""
    import jax

    from core.device import DeviceUnavailable, parse_device

    parsed = parse_device(device)
    if parsed is None:
        raise InvalidInput("the JAX runtime needs a resolved device (cpu, cuda, cuda:N), not auto")
    devices: list[Any] = []
    errors = []
    for backend in ("cpu",) if parsed.kind == "cpu" else ("cuda", "gpu"):
        try:
            devices = jax.devices(backend)
            break
        except RuntimeError as e:  # no such backend in this jax (jax without its CUDA plugin)
            errors.append(f"{backend}: {e}")
    if not devices:
        raise DeviceUnavailable(
            f"JAX has no {parsed.kind} backend here ({'; '.join(errors)}); install jax[cuda] for GPU evals",
            details={"device": str(parsed)},
        )
    index = parsed.index or 0
    if index >= len(devices):
        raise DeviceUnavailable(
            f"JAX sees {len(devices)} {parsed.kind} device(s); {parsed} is not one", details={"device": str(parsed)}
        )
    return list(devices[index:])


def _device_mesh(axes: dict[str, int], devices: list[Any]) -> Any:
    """The artifact's mesh over the platform's first devices; deferred when it has too few."""
    from jax.sharding import AxisType, Mesh

    shape = tuple(int(s) for s in axes.values())
    needed = int(np.prod(shape))
    if len(devices) < needed:
        raise Deferred(
            f"the artifact's mesh {axes} needs {needed} devices; this machine has {len(devices)} "
            f"({devices[0].platform})",
            details={"runtime_needed": f"jax on {needed} devices"},
        )
    grid = np.array(devices[:needed]).reshape(shape)
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(shape))


def _restore(
    checkpoint: Path, tensors: dict[str, Any], sharding: dict[str, Any], mesh: Any, device: Any
) -> dict[str, Any]:
    """`{name: jax.Array}` restored by orbax, each placed by its partition spec on `mesh` (or on `device`)."""
    import jax
    import orbax.checkpoint.experimental.v1 as ocp
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    from targets.orbax.layout import flatten, nest
    from targets.orbax.writer import quiet_orbax

    specs = sharding["partition_specs"]
    if set(specs) != set(tensors):
        raise StageFailed("orbax artifact: sharding.json and weights.json list different tensors")

    def place(name: str) -> Any:
        if mesh is None:
            return SingleDeviceSharding(device)
        return NamedSharding(mesh, PartitionSpec(*specs[name]))

    abstract = {
        name: jax.ShapeDtypeStruct(tuple(t["shape"]), jax.numpy.dtype(t["dtype"]), sharding=place(name))
        for name, t in tensors.items()
    }
    try:
        with quiet_orbax():
            stored = dict(flatten(ocp.metadata(checkpoint).metadata))
            for name, want in abstract.items():
                have = stored.get(name)
                if have is None or tuple(have.shape) != want.shape or np.dtype(have.dtype) != want.dtype:
                    raise StageFailed(
                        f"orbax checkpoint {str(checkpoint)!r}: tensor {name!r} is "
                        f"{'missing' if have is None else f'{have.dtype} {list(have.shape)}'}, weights.json says "
                        f"{want.dtype} {list(want.shape)}",
                        code="EVAL_RUNTIME_LOAD_FAILED",
                        details={"tensor": name},
                    )
            restored = ocp.load(checkpoint, nest(abstract))
    except (OSError, ValueError) as e:
        raise StageFailed(
            f"orbax could not restore {str(checkpoint)!r}: {e}",
            code="EVAL_RUNTIME_LOAD_FAILED",
            details={"runtime": "jax", "path": str(checkpoint)},
        ) from None
    return dict(flatten(restored))


# --- the forward pass (pure functions of the parameters; traced once per padded shape) -----------------


def _linear(params: dict[str, Any], module: str, x: Any, dtype: Any, precision: Any) -> Any:
    import jax.numpy as jnp

    w = params[module + ".weight"]
    y = jnp.einsum("ti,oi->to", x, w.astype(dtype), precision=precision)
    scale = params.get(module + ".weight_scale")
    if scale is not None:  # int8: x @ (q * s)^T == (x @ q^T) * s, s per output channel
        y = y * scale.astype(dtype)
    bias = params.get(module + ".bias")
    if bias is not None:
        y = y + bias.astype(dtype)
    return y


def _rms_norm(x: Any, weight: Any, eps: float, dtype: Any) -> Any:
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(dtype)


def _rope(x: Any, positions: Any, theta: float) -> Any:
    """Rotary embedding, transformers' layout: the two halves of each head are rotated as (x1, x2) pairs."""
    import jax.numpy as jnp

    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], axis=-1))[:, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], axis=-1))[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _forward(
    params: dict[str, Any], tokens: Any, start: Any, cache: Any, *, cfg: Any, dtype: Any, precision: Any
) -> tuple[Any, Any]:
    """Logits [T, V] (float32) of `tokens` [T] at positions start..start+T-1, and the KV cache with them written.

    `cache` holds one (keys, values) pair of [S, kv_heads, head_dim] per layer; a query attends to the
    cached keys at positions up to its own (within the sliding window, if any).
    """
    import jax
    import jax.numpy as jnp

    t = tokens.shape[0]
    s = cache[0][0].shape[0]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    positions = start + jnp.arange(t, dtype=jnp.int32)
    keys_at = jnp.arange(s, dtype=jnp.int32)
    visible = keys_at[None, :] <= positions[:, None]
    if cfg.sliding_window is not None:
        visible &= positions[:, None] - keys_at[None, :] < cfg.sliding_window

    x = params["model.embed_tokens.weight"][tokens].astype(dtype)
    new_cache = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, params[p + "input_layernorm.weight"], cfg.rms_norm_eps, dtype)
        q = _linear(params, p + "self_attn.q_proj", h, dtype, precision).reshape(t, nh, hd)
        k = _linear(params, p + "self_attn.k_proj", h, dtype, precision).reshape(t, nkv, hd)
        v = _linear(params, p + "self_attn.v_proj", h, dtype, precision).reshape(t, nkv, hd)
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        ck = jax.lax.dynamic_update_slice(cache[i][0], k.astype(cache[i][0].dtype), (start, 0, 0))
        cv = jax.lax.dynamic_update_slice(cache[i][1], v.astype(cache[i][1].dtype), (start, 0, 0))
        new_cache.append((ck, cv))
        # Grouped-query attention: query head j reads kv head j // (nh / nkv).
        qg = q.reshape(t, nkv, nh // nkv, hd)
        scores = jnp.einsum("tkgd,skd->kgts", qg, ck, precision=precision).astype(jnp.float32) * hd**-0.5
        scores = jnp.where(visible[None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        attn = jnp.einsum("kgts,skd->tkgd", probs, cv, precision=precision).reshape(t, nh * hd)
        x = x + _linear(params, p + "self_attn.o_proj", attn, dtype, precision)
        h = _rms_norm(x, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps, dtype)
        gate = _linear(params, p + "mlp.gate_proj", h, dtype, precision)
        up = _linear(params, p + "mlp.up_proj", h, dtype, precision)
        x = x + _linear(params, p + "mlp.down_proj", jax.nn.silu(gate) * up, dtype, precision)
    h = _rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps, dtype)
    head = params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    logits = jnp.einsum("th,vh->tv", h, head.astype(dtype), precision=precision)
    return logits.astype(jnp.float32), tuple(new_cache)


def _arithmetic(compute_dtype: ComputeDtype) -> tuple[Any, Any]:
    """(dtype, matmul precision) of `compute_dtype`: float32 at HIGHEST, which TPUs otherwise round to bf16."""
    import jax

    precision = jax.lax.Precision.HIGHEST if compute_dtype == "float32" else jax.lax.Precision.DEFAULT
    return jax.numpy.dtype(compute_dtype), precision


def _prefill(params: dict[str, Any], tokens: Any, *, cfg: Any, compute_dtype: ComputeDtype) -> tuple[Any, Any]:
    """The forward over `tokens` from position 0 on an empty cache of as many positions."""
    import jax.numpy as jnp

    dtype, precision = _arithmetic(compute_dtype)
    shape = (tokens.shape[0], cfg.num_kv_heads, cfg.head_dim)
    cache = tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))
    return _forward(params, tokens, 0, cache, cfg=cfg, dtype=dtype, precision=precision)


def _decode(
    params: dict[str, Any], tokens: Any, start: Any, cache: Any, *, cfg: Any, compute_dtype: ComputeDtype
) -> tuple[Any, Any]:
    """The forward over `tokens` at positions from `start` (traced: one program serves every step)."""
    dtype, precision = _arithmetic(compute_dtype)
    return _forward(params, tokens, start, cache, cfg=cfg, dtype=dtype, precision=precision)


class _Jitted:
    """`jax.jit(fn)` made on first use (importing jax is not free); shared by every runtime in the process, so
    artifacts of the same config, dtypes and shapes reuse one another's compiled programs."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._jitted: Any = None

    def __call__(self, *args: Any, **static: Any) -> Any:
        if self._jitted is None:
            import jax

            self._jitted = jax.jit(self._fn, static_argnames=("cfg", "compute_dtype"))
        return self._jitted(*args, **static)


_PREFILL = _Jitted(_prefill)
_DECODE = _Jitted(_decode)
