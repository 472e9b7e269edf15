"""JAX: the runtime of the orbax target, a decoder forward pass written in JAX and run under `jax.jit`.

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

The forward (`eval.runtimes.jax_forward`, with `jax_attention`, `jax_mixture` and `jax_ops`) is transformers'
computation of every family the orbax target maps (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 3,
Phi-3, DeepSeek-V3, gpt-oss), configured from the family's record and the model's shape
(`targets.orbax.forward.forward_config`), never by family name: RMSNorm (scaling by 1 + w for Gemma; also
after attention and after the MLP where the record has sandwich norms), per-head q/k RMSNorm before rope
(Qwen3, Gemma 3), rotary embeddings with each layer type's base (linear scaling or YaRN where configured; partial
rotary for Phi-3), grouped-query attention with a causal mask, each sliding layer's window and per-head sinks
(gpt-oss), or multi-head latent attention (DeepSeek-V3, non-absorbed, on a cache of latents), attention scaled by
head_dim^-1/2, Gemma's query_pre_attn_scalar^-1/2 or MLA's with YaRN's mscale, a gated MLP (SiLU or GELU-tanh) or,
in a sparse layer, a mixture of experts with its family's router (softmax then top-k, top-k then softmax, or
DeepSeek-V3's sigmoid group-limited choice), shared experts and gpt-oss's clamped SwiGLU, biases where stored, the
embedding scaled by sqrt(hidden) for Gemma, a tied or untied head, and Gemma's final logit soft-capping. The
layer's tensors are read by their role (`attn_q`, `ffn_gate_exps`), as the layout names them. int8 weights are
dequantized inside the program: a Linear layer's weight is q * scale with one scale per output
channel, so x @ (q * scale)^T is computed as (x @ q^T) * scale, the form weight-only int8 kernels use.

`compute_dtype` is the activation dtype: float32 (default) measures the artifact's weights with as
little rounding in the arithmetic as the reference has (float32 matmuls at HIGHEST precision, which
TPUs otherwise round to bf16); bfloat16 computes as a TPU serving stack does.

Sequences are padded to power-of-two buckets (padding sits after the real tokens, which the causal
mask keeps it from influencing), so one compiled program serves every window of a bucket, and every
layer of a kind: the programs are one decoder layer each, one per distinct `LayerConfig` (window, rope,
dense or experts). `greedy` decodes every prompt together on per-prompt KV caches (MLA's: latents and rope
keys): one prefill pass (a window program: the prompts padded to the cache's length, so the program already
compiled for the eval's windows serves it), then one pass over the layers per token, a jitted step at a traced
position; an eval does not call it (its greedy agreement is teacher-forced, scored with its windows:
`eval.run.measure`). The programs are jitted once per process (static: the config, the layer's and the compute
dtype), so artifacts of the same shapes share their compilations.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.error_codes import Codes
from kiln.core.errors import Deferred, InvalidInput, KilnError, StageFailed
from kiln.eval.runtimes.base import HEAD_BLOCK, RESIDENT_BYTES, check_ids, import_runtime
from kiln.eval.runtimes.jax_forward import DECODE, HEAD, NORM, PREFILL
from kiln.eval.runtimes.jax_ops import ComputeDtype

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
        from kiln.formats.architectures.shape import ModelShape
        from kiln.targets.orbax.forward import forward_config
        from kiln.targets.orbax.layout import FORMAT, FORMAT_VERSION, QUANTS, checkpoint_tensors, plan_checkpoint

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
        self._head_name = "model.embed_tokens.weight" if cfg.shape.tie_word_embeddings else "lm_head.weight"
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
                f"orbax artifact {str(self.path)!r} holds {unread[0]}, which the forward of {cfg.shape.architecture} "
                f"does not read ({len(unread)} such tensors)",
                details={"unread": unread[:8]},
            )
        _check_stored(self._checkpoint, self._abstract)
        self._layers = [
            sorted(n for n in self._abstract if n.startswith(f"model.layers.{i}.")) for i in range(cfg.shape.num_layers)
        ]
        self.checkpoint_bytes = sum(a.size * a.dtype.itemsize for a in self._abstract.values())
        self._resident = self.restore(list(self._abstract)) if self.checkpoint_bytes <= resident_bytes else None
        self.vocab_size = cfg.shape.vocab_size
        self.compute_dtype = compute_dtype
        self._buckets: set[int] = set()  # padded lengths whose prefill program this runtime has run
        self.version = (
            f"jax {jax.__version__}, orbax-checkpoint {orbax_checkpoint.__version__}, on {self.platform}, "
            + ("restored whole" if self._resident is not None else "restored one layer at a time")
        )

    def _load_failed(self, message: str, details: dict[str, Any] | None = None) -> StageFailed:
        return StageFailed(
            message,
            code=Codes.EVAL_RUNTIME_LOAD_FAILED,
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
            hidden = _done([PREFILL(layer, x, layer=spec, **static)[0] for x in hidden])
            del layer
        norm, head = self._restore_output()
        for ids, x in zip(checked, hidden, strict=True):
            yield self._head(NORM(x[: len(ids)], norm, **static), head)

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
            outs = _done([PREFILL(layer, x, layer=spec, **static) for x in hidden])
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
                    hidden[j], caches[li][j] = DECODE(layer, x, pos, caches[li][j], layer=spec, **static)
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

        from kiln.targets.orbax.layout import flatten, nest
        from kiln.targets.orbax.writer import quiet_orbax

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
            block = HEAD(
                h,
                head[lo : lo + size],
                compute_dtype=self.compute_dtype,
                softcap=self.config.shape.final_logit_softcapping,
            )
            out[:, lo : lo + size] = np.asarray(block)
        return out

    def _next_tokens(self, last: list[Any]) -> list[int]:
        """The argmax token after each prompt's last hidden state [1, hidden]."""
        static = {"cfg": self.config, "compute_dtype": self.compute_dtype}
        norm, head = self._restore_output()
        return [int(np.argmax(self._head(NORM(x, norm, **static), head)[0])) for x in last]


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

    from kiln.core.device import DeviceUnavailable, parse_device

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

    from kiln.targets.orbax.layout import flatten
    from kiln.targets.orbax.writer import quiet_orbax

    try:
        with quiet_orbax():
            stored = dict(flatten(ocp.metadata(checkpoint).metadata))
    except (OSError, ValueError) as e:
        raise StageFailed(
            f"orbax could not read {str(checkpoint)!r}: {e}",
            code=Codes.EVAL_RUNTIME_LOAD_FAILED,
            details={"runtime": "jax", "path": str(checkpoint)},
        ) from None
    for name, want in abstract.items():
        have = stored.get(name)
        if have is None or tuple(have.shape) != want.shape or np.dtype(have.dtype) != want.dtype:
            raise StageFailed(
                f"orbax checkpoint {str(checkpoint)!r}: tensor {name!r} is "
                f"{'missing' if have is None else f'{have.dtype} {list(have.shape)}'}, weights.json says "
                f"{want.dtype} {list(want.shape)}",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"tensor": name},
            )
