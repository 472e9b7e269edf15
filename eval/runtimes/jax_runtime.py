"""JAX: the runtime of the orbax target, a Llama-family forward pass written in JAX and run under `jax.jit`.

The artifact's orbax checkpoint (`targets.orbax.layout` describes it) is restored one piece at a time with
orbax's partial load (every other tensor a placeholder it does not read): the embedding table, to gather
the calls' rows; then each decoder layer in turn, which runs over every window of the call (layer-major, as
`eval.runtimes.layer_stream` runs transformers) and is dropped before the next is restored; then the final
norm and the output head, applied `HEAD_BLOCK` vocabulary rows at a time (a checkpoint of at most
`RESIDENT_BYTES` is restored once instead, and the same programs run on it). So memory is one layer, the
largest of the embedding and the head in the checkpoint's dtype, the hidden states of the call's windows
and one window's [tokens, vocab] float32 logits, whatever the model's size, where restoring the whole
checkpoint held ~3x the bf16 model (`pipeline.requirements` plans with it). Arrays go
on one device by default, or, with `mesh=True`, onto the artifact's mesh with every array placed by its
`sharding.json` partition spec (`NamedSharding`), the way a TPU slice loads it; XLA then partitions the
same jitted programs over the mesh.

The device is explicit, never JAX's default backend: `device` is the stage's (`cpu`, `cuda:N`;
`pipeline.placement`), the platform whose devices the arrays are restored onto (the first N+1 for
a mesh), so with jax[cuda] installed a CPU stage still computes on the CPU and a GPU stage on its
GPU, with the same code path. The platform is recorded in `version` (and so in the eval report).

The forward is transformers' computation of every family the orbax target maps (Llama, Mistral, Qwen2,
Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3), configured from the family's record and the model's shape
(`targets.orbax.layout.forward_config`), never by family name: RMSNorm (scaling by 1 + w for Gemma; also
after attention and after the MLP where the record has sandwich norms), per-head q/k RMSNorm before rope
(Qwen3, Gemma 3), rotary embeddings with each layer type's base (linear scaling where configured; partial
rotary for Phi-3), grouped-query attention with a causal mask and each sliding layer's window, attention
scaled by head_dim^-1/2 or Gemma's query_pre_attn_scalar^-1/2, a gated MLP (SiLU or GELU-tanh) or, in a
sparse layer, a softmax top-k mixture of experts (`_moe`), q/k/v biases where stored, the embedding scaled
by sqrt(hidden) for Gemma, a tied or untied head, and Gemma's final logit soft-capping. The layer's tensors
are read by their role (`attn_q`, `ffn_gate_exps`), as the layout names them. int8 weights are
dequantized inside the program: a Linear layer's weight is q * scale with one scale per output
channel, so x @ (q * scale)^T is computed as (x @ q^T) * scale, the form weight-only int8 kernels use.

`compute_dtype` is the activation dtype: float32 (default) measures the artifact's weights with as
little rounding in the arithmetic as the reference has (float32 matmuls at HIGHEST precision, which
TPUs otherwise round to bf16); bfloat16 computes as a TPU serving stack does.

Sequences are padded to power-of-two buckets (padding sits after the real tokens, which the causal
mask keeps it from influencing), so one compiled program serves every window of a bucket, and every
layer of a kind: the programs are one decoder layer each, one per distinct `LayerConfig` (window, rope,
dense or experts). `greedy` decodes every prompt together on per-prompt KV caches: one prefill pass (a
window program: the prompts padded to the cache's length, so the program already compiled for the eval's
windows serves it), then one pass over the layers per token, a jitted step at a traced position; an eval
does not call it (its greedy agreement is teacher-forced, scored with its windows: `eval.run.measure`). The
programs are jitted once per process (static: the config, the layer's and the compute dtype), so
artifacts of the same shapes share their compilations.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from core.errors import Deferred, InvalidInput, KilnError, StageFailed
from eval.runtimes.base import HEAD_BLOCK, RESIDENT_BYTES, check_ids, import_runtime

ComputeDtype = Literal["float32", "bfloat16"]
MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The padded length that serves `n` tokens: the next power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


class JaxRuntime:
    """An orbax artifact directory served by a jitted forward pass, its checkpoint restored one layer at a time."""

    name = "jax"

    def __init__(
        self,
        artifact: str | Path,
        *,
        mesh: bool = False,
        compute_dtype: ComputeDtype = "float32",
        device: str = "cpu",
        resident_bytes: int = RESIDENT_BYTES,
    ) -> None:
        # JAX takes 75% of a GPU's memory when its CUDA backend starts, by default; the torch stages that run
        # in the same process (the local executor) need theirs, so it allocates what it uses instead.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        jax, orbax_checkpoint = import_runtime(("jax", "orbax.checkpoint"), "jax")
        from formats.architectures.shape import ModelShape
        from targets.orbax.layout import (
            FORMAT,
            FORMAT_VERSION,
            QUANTS,
            checkpoint_tensors,
            forward_config,
            plan_checkpoint,
        )

        if compute_dtype not in ("float32", "bfloat16"):
            raise InvalidInput(f"compute_dtype must be float32 or bfloat16, got {compute_dtype!r}")
        self.path = Path(artifact)
        if not self.path.is_dir():
            raise InvalidInput(
                f"orbax artifact {str(self.path)!r} is not a directory", details={"path": str(self.path)}
            )
        weights, sharding, config = (self._read_json(n) for n in ("weights.json", "sharding.json", "config.json"))
        try:
            shape = ModelShape.from_config(config)
            self.config = forward_config(shape, config)
            planned = checkpoint_tensors(plan_checkpoint(shape, QUANTS["bf16"]))
        except KilnError as e:
            raise self._load_failed(f"the JAX forward cannot serve {str(self.path)!r}: {e.message}") from None
        if weights.get("format") != FORMAT or weights.get("format_version") != FORMAT_VERSION:
            raise self._load_failed(
                f"{str(self.path)!r} is not a {FORMAT} artifact of version {FORMAT_VERSION} "
                f"(weights.json says {weights.get('format')!r} version {weights.get('format_version')!r})"
            )
        self.quant = str(weights.get("quant"))
        self.devices = platform_devices(device)
        self.platform = self.devices[0].platform
        try:
            self.mesh = _device_mesh(sharding["mesh"], self.devices) if mesh else None
            self._checkpoint = self.path / weights["checkpoint"]
            self._abstract = _abstract(weights["tensors"], sharding["partition_specs"], self.mesh, self.devices[0])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise self._load_failed(
                f"orbax artifact {str(self.path)!r}: weights.json or sharding.json is malformed ({e!r})"
            ) from None
        cfg = self.config
        self._head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        missing = sorted(set(planned) - set(self._abstract))
        if missing:
            raise self._load_failed(
                f"orbax artifact {str(self.path)!r} lacks {missing[0]} ({len(missing)} tensors the forward reads)",
                details={"missing": missing[:8]},
            )
        # Each layer tensor's name in the forward: its role (`attn_q`), or its weight's role with `.scale`.
        self._keys = {n: t.key for n, t in planned.items() if t.layer is not None}
        for name in self._abstract:
            weight = planned.get(name.removesuffix("_scale"))
            if name.endswith(".weight_scale") and weight is not None and weight.layer is not None:
                self._keys[name] = f"{weight.kind.value}.scale"
        unread = sorted(n for n in self._abstract if n not in planned and n not in self._keys)
        if unread:
            raise self._load_failed(
                f"orbax artifact {str(self.path)!r} holds {unread[0]}, which the forward of {cfg.architecture} "
                f"does not read ({len(unread)} such tensors)",
                details={"unread": unread[:8]},
            )
        _check_stored(self._checkpoint, self._abstract)
        self._layers = [
            sorted(n for n in self._abstract if n.startswith(f"model.layers.{i}.")) for i in range(cfg.num_layers)
        ]
        self.checkpoint_bytes = sum(a.size * a.dtype.itemsize for a in self._abstract.values())
        self._resident = self.restore(list(self._abstract)) if self.checkpoint_bytes <= resident_bytes else None
        self.vocab_size = cfg.vocab_size
        self.compute_dtype = compute_dtype
        self._buckets: set[int] = set()  # padded lengths whose prefill program this runtime has run
        self.version = (
            f"jax {jax.__version__}, orbax-checkpoint {orbax_checkpoint.__version__}, on {self.platform}, "
            + ("restored whole" if self._resident is not None else "restored one layer at a time")
        )

    def _load_failed(self, message: str, details: dict[str, Any] | None = None) -> StageFailed:
        return StageFailed(
            message,
            code="EVAL_RUNTIME_LOAD_FAILED",
            details={"runtime": self.name, "path": str(self.path), **(details or {})},
        )

    def _read_json(self, name: str) -> dict[str, Any]:
        try:
            value = json.loads((self.path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise self._load_failed(
                f"orbax artifact {str(self.path)!r}: cannot read {name}: {e}", details={"file": name}
            ) from None
        if not isinstance(value, dict):
            raise self._load_failed(f"orbax artifact: {name} is not a JSON object", details={"file": name})
        return value

    # -- the Runtime protocol -------------------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return next(self.logits_many([token_ids]))

    def logits_many(self, windows: Sequence[Sequence[int]]) -> Iterator[np.ndarray]:
        """Each window's logits, float32 [len(window), vocab], in order: every layer is restored once and runs
        over all windows (each padded to its bucket), then the head yields one window at a time."""
        checked = [check_ids(w, self.vocab_size, self.name) for w in windows]
        hidden = self._embed([_padded(ids, bucket(len(ids))) for ids in checked])
        self._buckets.update(int(x.shape[0]) for x in hidden)
        static = {"cfg": self.config, "compute_dtype": self.compute_dtype}
        for names, spec in zip(self._layers, self.config.layers, strict=True):
            layer = self._restore_layer(names)
            hidden = _done([_PREFILL(layer, x, layer=spec, **static)[0] for x in hidden])
            del layer
        norm, head = self._restore_output()
        for ids, x in zip(checked, hidden, strict=True):
            yield self._head(_NORM(x[: len(ids)], norm, **static), head)

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        """Argmax continuations of every prompt, decoded together on per-prompt KV caches: one prefill pass over
        the layers, then one pass per generated token (each layer restored once per pass, for every prompt)."""
        checked = [check_ids(p, self.vocab_size, self.name) for p in prompts]
        if n <= 0 or not checked:
            return [[] for _ in checked]
        static = {"cfg": self.config, "compute_dtype": self.compute_dtype}
        # Prompts are padded to the cache's length, so the prefill is a window program; one this runtime has
        # already compiled (for the eval's windows) when one is long enough: an XLA compile costs ~1 s.
        needed = bucket(max(len(ids) for ids in checked) + n)
        cache_len = min((b for b in self._buckets if b >= needed), default=needed)
        self._buckets.add(cache_len)
        hidden = self._embed([_padded(ids, cache_len) for ids in checked])
        caches: list[list[Any]] = []
        for names, spec in zip(self._layers, self.config.layers, strict=True):
            layer = self._restore_layer(names)
            outs = _done([_PREFILL(layer, x, layer=spec, **static) for x in hidden])
            del layer
            hidden = [x for x, _ in outs]
            caches.append([kv for _, kv in outs])
        last = [x[len(ids) - 1 : len(ids)] for ids, x in zip(checked, hidden, strict=True)]
        tokens = self._next_tokens(last)
        generated = [[t] for t in tokens]
        for i in range(1, n):
            # The token generated last goes in at the next position; its logits give the next token. Its cache
            # row overwrites the padding's (which no query at or before it could see).
            positions = [np.int32(len(ids) + i - 1) for ids in checked]
            hidden = self._embed([np.array([t], dtype=np.int32) for t in tokens])
            for li, (names, spec) in enumerate(zip(self._layers, self.config.layers, strict=True)):
                layer = self._restore_layer(names)
                for j, (x, pos) in enumerate(zip(hidden, positions, strict=True)):
                    hidden[j], caches[li][j] = _DECODE(layer, x, pos, caches[li][j], layer=spec, **static)
                _done(hidden)
                del layer
            tokens = self._next_tokens(hidden)
            for row, t in zip(generated, tokens, strict=True):
                row.append(t)
        return generated

    def close(self) -> None:
        self._buckets.clear()
        self._resident = None

    # -- restoring --------------------------------------------------------------------------------------------

    def restore(self, names: Sequence[str]) -> dict[str, Any]:
        """`{name: jax.Array}` of `names` only, placed by the artifact's sharding plan (or on the device): orbax's
        partial load, every other tensor of the checkpoint a placeholder it does not read."""
        import orbax.checkpoint.experimental.v1 as ocp

        from targets.orbax.layout import flatten, nest
        from targets.orbax.writer import quiet_orbax

        wanted = set(names)
        tree = nest({n: (a if n in wanted else ocp.PLACEHOLDER) for n, a in self._abstract.items()})
        try:
            with quiet_orbax():
                restored = ocp.load(self._checkpoint, tree)
        except (OSError, ValueError) as e:
            raise self._load_failed(f"orbax could not restore {str(self._checkpoint)!r}: {e}") from None
        return {n: a for n, a in flatten(restored) if n in wanted}

    def _arrays(self, names: Sequence[str]) -> dict[str, Any]:
        """`names`' arrays: the resident ones of a small checkpoint, else restored for this use."""
        if self._resident is not None:
            return {n: self._resident[n] for n in names}
        return self.restore(names)

    def _restore_layer(self, names: list[str]) -> dict[str, Any]:
        """One decoder layer's arrays, keyed by the role each plays (`attn_q`, `attn_q.bias`, `ffn_up_exps.scale`:
        `targets.orbax.layout.CheckpointTensor.key`), so the forward reads every family's layout alike."""
        return {self._keys[n]: a for n, a in self._arrays(names).items()}

    def _restore_output(self) -> tuple[Any, Any]:
        arrays = self._arrays(["model.norm.weight", self._head_name])
        return arrays["model.norm.weight"], arrays[self._head_name]

    def _embed(self, ids: Sequence[np.ndarray]) -> list[Any]:
        """Each id array's embedding rows in the compute dtype; the table is restored for the call and dropped."""
        import jax.numpy as jnp

        [table] = self._arrays(["model.embed_tokens.weight"]).values()
        dtype = jnp.dtype(self.compute_dtype)
        rows = [jnp.take(table, jnp.asarray(i, dtype=jnp.int32), axis=0).astype(dtype) for i in ids]
        scale = self.config.embedding_scale
        if scale is None:
            return rows
        # Gemma: times sqrt(hidden) rounded to the compute dtype, as transformers multiplies in the weights' dtype.
        return [x * jnp.asarray(scale, dtype=dtype) for x in rows]

    def _head(self, h: Any, head: Any) -> np.ndarray:
        """[tokens, vocab] float32 logits of final hidden states `h`, `HEAD_BLOCK` vocabulary rows at a time, so
        the [vocab, hidden] matrix is never cast whole to the compute dtype."""
        vocab = int(head.shape[0])
        out = np.empty((int(h.shape[0]), vocab), dtype=np.float32)
        for lo in range(0, vocab, HEAD_BLOCK):
            size = min(HEAD_BLOCK, vocab - lo)
            # Sliced outside the program: inside it, XLA's first run held a second copy of the whole head.
            block = _HEAD(
                h, head[lo : lo + size], compute_dtype=self.compute_dtype, softcap=self.config.final_logit_softcapping
            )
            out[:, lo : lo + size] = np.asarray(block)
        return out

    def _next_tokens(self, last: list[Any]) -> list[int]:
        """The argmax token after each prompt's last hidden state [1, hidden]."""
        static = {"cfg": self.config, "compute_dtype": self.compute_dtype}
        norm, head = self._restore_output()
        return [int(np.argmax(self._head(_NORM(x, norm, **static), head)[0])) for x in last]


def _done(outputs: Any) -> Any:
    """`outputs` once computed. JAX dispatches asynchronously: without waiting, the next layer would be restored
    while this one still computes, and on a slow device every layer of the model could be held at once."""
    import jax

    return jax.block_until_ready(outputs)


def _padded(ids: list[int], length: int) -> np.ndarray:
    """`ids` followed by zeros up to `length` (the causal mask keeps the padding from every real token)."""
    out = np.zeros(length, dtype=np.int32)
    out[: len(ids)] = ids
    return out


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


def _abstract(tensors: dict[str, Any], specs: dict[str, Any], mesh: Any, device: Any) -> dict[str, Any]:
    """`{name: jax.ShapeDtypeStruct}` of every tensor weights.json lists, each placed by its partition spec on
    `mesh` (or on `device`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    if set(specs) != set(tensors):
        raise StageFailed("orbax artifact: sharding.json and weights.json list different tensors")

    def place(name: str) -> Any:
        if mesh is None:
            return SingleDeviceSharding(device)
        return NamedSharding(mesh, PartitionSpec(*specs[name]))

    return {
        name: jax.ShapeDtypeStruct(tuple(t["shape"]), jax.numpy.dtype(t["dtype"]), sharding=place(name))
        for name, t in tensors.items()
    }


def _check_stored(checkpoint: Path, abstract: dict[str, Any]) -> None:
    """Every tensor is in the checkpoint with the dtype and shape weights.json says (orbax would cast silently)."""
    import orbax.checkpoint.experimental.v1 as ocp

    from targets.orbax.layout import flatten
    from targets.orbax.writer import quiet_orbax

    try:
        with quiet_orbax():
            stored = dict(flatten(ocp.metadata(checkpoint).metadata))
    except (OSError, ValueError) as e:
        raise StageFailed(
            f"orbax could not read {str(checkpoint)!r}: {e}",
            code="EVAL_RUNTIME_LOAD_FAILED",
            details={"runtime": "jax", "path": str(checkpoint)},
        ) from None
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


# --- the forward pass, one decoder layer per call (pure functions; traced once per padded shape) -----------


# The layer's tensors by role (`formats.architectures.record.TensorKind`), as `JaxRuntime._restore_layer` keys them.
_ATTN_NORM, _FFN_NORM = "attn_norm", "ffn_norm"
_ATTN_POST_NORM, _FFN_POST_NORM = "attn_post_norm", "ffn_post_norm"


def _linear(params: dict[str, Any], kind: str, x: Any, dtype: Any, precision: Any) -> Any:
    import jax.numpy as jnp

    w = params[kind]
    y = jnp.einsum("ti,oi->to", x, w.astype(dtype), precision=precision)
    scale = params.get(kind + ".scale")
    if scale is not None:  # int8: x @ (q * s)^T == (x @ q^T) * s, s per output channel
        y = y * scale.astype(dtype)
    bias = params.get(kind + ".bias")
    if bias is not None:
        y = y + bias.astype(dtype)
    return y


def _rms_norm(x: Any, weight: Any, eps: float, offset: float, dtype: Any) -> Any:
    """RMSNorm over the last axis in float32, scaled by (offset + w): Gemma's norms store w around 0 (offset 1)."""
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return ((offset + weight.astype(jnp.float32)) * normed).astype(dtype)


def _activation(name: str, x: Any) -> Any:
    import jax

    return jax.nn.silu(x) if name == "silu" else jax.nn.gelu(x, approximate=True)


def _rope(x: Any, positions: Any, rotary_dim: int, theta: float, factor: float) -> Any:
    """Rotary embedding, transformers' layout: the two halves of the first `rotary_dim` dimensions of each head are
    rotated as (x1, x2) pairs, the rest pass through (Phi-3's partial rotary); linear scaling divides the
    frequencies by `factor`."""
    import jax.numpy as jnp

    d = rotary_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if factor != 1.0:
        inv_freq = inv_freq / factor
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], axis=-1))[:, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], axis=-1))[:, None, :]
    rot = x[..., :d]
    x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (rot.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
    return out if d == x.shape[-1] else jnp.concatenate([out, x[..., d:]], axis=-1)


def _mlp(params: dict[str, Any], h: Any, *, cfg: Any, dtype: Any, precision: Any) -> Any:
    """The gated MLP: down(act(gate(h)) * up(h))."""
    gate = _linear(params, "ffn_gate", h, dtype, precision)
    up = _linear(params, "ffn_up", h, dtype, precision)
    return _linear(params, "ffn_down", _activation(cfg.activation, gate) * up, dtype, precision)


def _experts(params: dict[str, Any], kind: str, spec: str, x: Any, dtype: Any, precision: Any) -> Any:
    """Every expert's Linear of `kind` ([experts, out, in], int8 scales [experts, out]) applied by einsum `spec`."""
    import jax.numpy as jnp

    y = jnp.einsum(spec, x, params[kind].astype(dtype), precision=precision)
    scale = params.get(kind + ".scale")
    return y if scale is None else y * scale.astype(dtype)[None]


def _moe(params: dict[str, Any], h: Any, *, cfg: Any, dtype: Any, precision: Any) -> Any:
    """A mixture of experts as transformers' Qwen3-MoE and Mixtral blocks compute it: a softmax over every expert's
    router logit (float32), the top k kept, renormalised to sum to 1 when `norm_topk_prob`; each chosen expert's
    SwiGLU output weighted by its probability and summed.

    Computed densely: every expert runs on every token and the experts not chosen weigh 0, so one program with no
    data-dependent shapes serves every call, and a mesh that splits the expert axis reduces the weighted sum over
    it. That costs experts / k times the routed FLOPs and holds [tokens, experts, moe_intermediate] activations:
    right for an evaluation's few thousand tokens, not for serving (which gathers each expert's tokens)."""
    import jax
    import jax.numpy as jnp

    logits = jnp.einsum("th,eh->te", h, params["ffn_gate_inp"].astype(dtype), precision=precision)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, chosen = jax.lax.top_k(probs, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    # [tokens, experts]: each chosen expert's weight, 0 for the others (one-hot rows sum exactly: k distinct experts).
    weights = jnp.einsum("tk,tke->te", top, jax.nn.one_hot(chosen, cfg.experts, dtype=jnp.float32)).astype(dtype)
    gate = _experts(params, "ffn_gate_exps", "th,efh->tef", h, dtype, precision)
    up = _experts(params, "ffn_up_exps", "th,efh->tef", h, dtype, precision)
    out = _experts(params, "ffn_down_exps", "tef,ehf->teh", _activation(cfg.activation, gate) * up, dtype, precision)
    return jnp.einsum("te,teh->th", weights, out, precision=precision)


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
    """One decoder layer over hidden states `x` [T, hidden] at positions start..start+T-1, and its KV cache
    (keys, values) of [S, kv_heads, head_dim] with them written; a query attends to the cached keys at
    positions up to its own (within the layer's sliding window, if any). `params` are the layer's, by role
    (`attn_q`); `layer` is what this layer's computation has of its own (`LayerConfig`: window, rope, experts)."""
    import jax
    import jax.numpy as jnp

    t = x.shape[0]
    s = cache[0].shape[0]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    positions = start + jnp.arange(t, dtype=jnp.int32)
    keys_at = jnp.arange(s, dtype=jnp.int32)
    visible = keys_at[None, :] <= positions[:, None]
    if layer.window is not None:
        visible &= positions[:, None] - keys_at[None, :] < layer.window

    def norm(v: Any, kind: str) -> Any:
        return _rms_norm(v, params[kind], cfg.rms_norm_eps, cfg.norm_offset, dtype)

    h = norm(x, _ATTN_NORM)
    q = _linear(params, "attn_q", h, dtype, precision).reshape(t, nh, hd)
    k = _linear(params, "attn_k", h, dtype, precision).reshape(t, nkv, hd)
    v = _linear(params, "attn_v", h, dtype, precision).reshape(t, nkv, hd)
    if cfg.qk_norm:  # per head, before rope
        q, k = norm(q, "attn_q_norm"), norm(k, "attn_k_norm")
    q = _rope(q, positions, cfg.rotary_dim, layer.rope_theta, layer.rope_factor)
    k = _rope(k, positions, cfg.rotary_dim, layer.rope_theta, layer.rope_factor)
    ck = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (start, 0, 0))
    cv = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (start, 0, 0))
    # Grouped-query attention: query head j reads kv head j // (nh / nkv).
    qg = q.reshape(t, nkv, nh // nkv, hd)
    scores = jnp.einsum("tkgd,skd->kgts", qg, ck, precision=precision).astype(jnp.float32) * cfg.attention_scale
    scores = jnp.where(visible[None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    attn = jnp.einsum("kgts,skd->tkgd", probs, cv, precision=precision).reshape(t, nh * hd)
    attn = _linear(params, "attn_output", attn, dtype, precision)
    if cfg.sandwich_norms:
        attn = norm(attn, _ATTN_POST_NORM)
    x = x + attn
    h = norm(x, _FFN_NORM)
    mlp = (_moe if layer.sparse else _mlp)(params, h, cfg=cfg, dtype=dtype, precision=precision)
    if cfg.sandwich_norms:
        mlp = norm(mlp, _FFN_POST_NORM)
    return x + mlp, (ck, cv)


def _arithmetic(compute_dtype: ComputeDtype) -> tuple[Any, Any]:
    """(dtype, matmul precision) of `compute_dtype`: float32 at HIGHEST, which TPUs otherwise round to bf16."""
    import jax

    precision = jax.lax.Precision.HIGHEST if compute_dtype == "float32" else jax.lax.Precision.DEFAULT
    return jax.numpy.dtype(compute_dtype), precision


def _prefill(
    params: dict[str, Any], x: Any, *, cfg: Any, layer: Any, compute_dtype: ComputeDtype
) -> tuple[Any, tuple[Any, Any]]:
    """One layer over `x` from position 0, on an empty cache of as many positions."""
    import jax.numpy as jnp

    dtype, precision = _arithmetic(compute_dtype)
    shape = (x.shape[0], cfg.num_kv_heads, cfg.head_dim)
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
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
    dtype, precision = _arithmetic(compute_dtype)
    return _layer(params, x, start, cache, cfg=cfg, layer=layer, dtype=dtype, precision=precision)


def _norm(x: Any, weight: Any, *, cfg: Any, compute_dtype: ComputeDtype) -> Any:
    """The final RMSNorm."""
    dtype, _ = _arithmetic(compute_dtype)
    return _rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_offset, dtype)


def _head_block(h: Any, block: Any, *, compute_dtype: ComputeDtype, softcap: float | None) -> Any:
    """Logits [T, rows] (float32) of a block of the output head's vocabulary rows, soft-capped to (-cap, cap) as
    cap * tanh(logits / cap) where the model caps them (Gemma's final_logit_softcapping)."""
    import jax.numpy as jnp

    dtype, precision = _arithmetic(compute_dtype)
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


_PREFILL = _Jitted(_prefill, ("cfg", "layer", "compute_dtype"))
_DECODE = _Jitted(_decode, ("cfg", "layer", "compute_dtype"))
_NORM = _Jitted(_norm)
_HEAD = _Jitted(_head_block, ("compute_dtype", "softcap"))
