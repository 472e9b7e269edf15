"""A causal LM forward one decoder layer at a time: memory is one layer, whatever the model's size.

A float32 Llama-3-70B is 282 GB and an 8B one 32 GB; neither fits a 24 GiB host or one 80 GB GPU
whole. `LayerStream` runs transformers' own modules (the architecture's decoder layer, norm and
rotary embedding, built on the meta device from config.json) but holds the weights of only one of
them at a time, read from the SafeTensors shards and cast to `dtype` on `device` just before use:

- windows go through the model layer-major: every window's hidden states ([tokens, hidden] float32,
  64 MiB for 4,096 tokens at hidden 4,096) pass layer i before layer i + 1 is loaded, so each layer
  is read once per call, not once per window;
- the embedding is gathered row by row from the mapped file and the output head is applied in blocks
  of `HEAD_BLOCK` vocabulary rows, so neither [vocab, hidden] matrix is ever whole in float32
  (each is the model's largest tensor: 2.1 GB in float32 at 128,256 x 4,096);
- greedy continuation decodes on transformers' KV cache with the same layer-major order (a prefill, then
  `n - 1` single-token steps). Each step needs every layer again: what the stream was allowed to keep
  (`resident_bytes`, what the stage's memory budget leaves, `eval.runtimes.residency`: the head, which every
  window needs too, then the layers in order) stays cast on the device after its first use, and only the
  rest is read again per token. An eval never decodes here: its greedy agreement is teacher-forced, its
  sequences scored in the same pass as its windows (`eval.run.measure`).

What it reads is counted (`core.usage.weights_read`): the stage's provenance records the passes over the
weights.

The arithmetic is the whole model's: the same modules, the same causal mask (transformers'
`create_causal_mask`, or its sliding-window twin where the architecture uses one) and the same
rotary embedding, in `dtype` (float32 for the reference, so the checkpoint's bf16 weights are used
exactly). Peak memory: one layer in `dtype` plus its checkpoint-dtype read, the hidden states of the
call's windows, one window's [tokens, vocab] float32 logits, and the resident layers; `pipeline.requirements`
plans with it.

Every family whose record streams (`Architecture.streams`: `STREAMED`) runs this way, its layers' weights
loaded by transformers' own loader (`convert_and_load_state_dict_in_model`) given that layer's tensors, so a
checkpoint's per-expert tensors become transformers' fused 3-D experts by its conversion mapping, one
layer at a time, as `from_pretrained` converts the whole model; what differs between families is read from
the modules and the record: rotary embeddings per layer type where the architecture has one per type
(Gemma 3's global and sliding bases), the embedding's scale (Gemma's sqrt(hidden), in `dtype`) and the
head's final logit soft-capping.

It computes the reference (the source release) and evaluates hf-bundle and rocm-bundle artifacts in
transformers (`open_transformers`). A compressed-tensors bundle is built on the meta device the way
transformers' own loader prepares it (its `CompressedTensorsHfQuantizer`: each quantized Linear with its
scheme and compressed layout), and each layer, as it is needed, gets a fresh copy of that layout, its
stored tensors, and compressed-tensors' own decompression; its forward then fake-quantizes activations
as the whole-model load does. The logits equal `TransformersRuntime`'s bit for bit (tests/eval/
test_layer_stream.py checks every scheme), with one layer decompressed at a time instead of the model:
an FP8 Llama-3-70B bundle evaluates on one GPU. A bundle's experts are one quantized Linear per expert
projection (`eval.runtimes.experts`), as in the whole-model load. ROCm's float8_e4m3fnuz weights are read as e4m3fn with
the scale halved (exact; `transformers_runtime._load_e4m3fnuz_exactly` does the same for the whole model).

A pre-quantized source (FP8 block, MXFP4 experts: `formats.prequantized`) is computed from its dequantized
weights, always here, whole or streamed: its model is built plain (transformers' own FP8 loading would either
run its FP8 kernels, quantizing the activations too, or dequantize a block that overhangs the matrix with the
wrong block), and each quantized tensor is dequantized into float32 as its layer is read (`dequantized`
names the layout; the reference stage records it).
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import numpy as np

from kiln.core.error_codes import Codes
from kiln.core.errors import StageFailed
from kiln.core.usage import weights_opened, weights_read
from kiln.eval.runtimes.base import (
    HEAD_BLOCK,
    check_ids,
    checkpoint_bytes,
    greedy_by_length,
    import_torch_transformers,
)
from kiln.eval.runtimes.experts import loading_experts
from kiln.eval.runtimes.residency import WHOLE, Residency
from kiln.eval.runtimes.transformers_runtime import (
    TransformersRuntime,
    as_declared,
    compressed_tensors_quantizer,
    runtime_version,
)
from kiln.formats.architectures import ARCHITECTURES
from kiln.formats.architectures.record import Architecture
from kiln.formats.hf_model import quantized_plan
from kiln.formats.prequantized import QuantizedPlan, declares_prequantized, dequantize

# The families whose causal-LM forward is embed -> decoder layers (one mask and rotary embedding per layer type)
# -> norm -> head, by config.json's model_type: every record that says it streams.
STREAMED: Final[dict[str, Architecture]] = {t: a for a in ARCHITECTURES.values() if a.streams for t in a.model_types}
STREAMED_MODEL_TYPES: Final = frozenset(STREAMED)


class LayerStream:
    """A causal LM from a SafeTensors directory, computed one layer at a time on `device` in `dtype`."""

    name = "transformers"

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        *,
        resident_bytes: int = 0,
        whole: bool = False,
        quantize_activations: bool = True,
    ) -> None:
        """`whole`: keep every layer once read (a pre-quantized source planned whole), `resident_bytes` aside;
        `quantize_activations` False: a bundle's Linears take their inputs as the reference does
        (`transformers_runtime.leave_activations`)."""
        torch, transformers = import_torch_transformers()
        self._torch = torch
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        try:
            config = transformers.AutoConfig.from_pretrained(str(self.model_dir))
        except (OSError, ValueError, KeyError) as e:
            raise StageFailed(
                f"transformers could not read {str(self.model_dir)!r}'s config: {e}",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"runtime": self.name, "path": str(self.model_dir)},
            ) from None
        record = STREAMED.get(config.model_type)
        if record is None:
            raise StageFailed(
                f"the layer-streamed forward covers {sorted(STREAMED_MODEL_TYPES)}, not {config.model_type!r}",
                code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
                details={"model_type": config.model_type},
            )
        from transformers.conversion_mapping import get_model_conversion_mapping

        plan = quantized_plan(self.model_dir)
        # The layout a pre-quantized source is read dequantized from (None: a plain checkpoint or a bundle).
        self.dequantized: str | None = plan.quantization.layout.name if plan is not None else None
        if plan is not None:  # built plain: its quantized tensors are dequantized as they are read
            del config.quantization_config
        quantizer = compressed_tensors_quantizer(config, self.model_dir)
        with loading_experts(config):  # a bundle's experts as one quantized Linear each, as the whole load
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(
                    config, dtype=self.dtype, attn_implementation="sdpa"
                )
            if quantizer is not None:  # each quantized Linear in its compressed layout, as transformers loads it
                quantizer._process_model_before_weight_loading(model)
            # The checkpoint's names to the modules' (and per-expert tensors to fused experts), as from_pretrained.
            self._conversions = get_model_conversion_mapping(model, hf_quantizer=quantizer)
        self._quantizer = quantizer
        self._fp4 = False
        self.config = config
        self._model: Any = model.eval()
        self._base: Any = model.get_decoder()
        self._prefix = f"{model.base_model_prefix}."
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)
        # The rotary embedding's frequencies are computed, not stored: build it for real on the device.
        self._rotary = type(self._base.rotary_emb)(config=config).to(self.device)
        # Gemma 3 holds one per layer type (its global and sliding layers' bases); Llama's is one for all.
        self._rotary_by_type = "layer_type" in inspect.signature(self._rotary.forward).parameters
        # Gemma's embedding multiplies by sqrt(hidden) (`Gemma3TextScaledWordEmbedding`): its own number.
        self._embed_scale: float | None = getattr(self._base.embed_tokens, "scalar_embed_scale", None)
        if (self._embed_scale is not None) != (record.norms.embedding_scale != "none"):
            raise StageFailed(
                f"transformers' {type(self._base.embed_tokens).__name__} and the {record.family} record disagree "
                f"on the embedding's scale ({record.norms.embedding_scale})",
                code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
            )
        self._softcap: float | None = getattr(config, "final_logit_softcapping", None)
        weights = _WeightIndex(self.model_dir)
        self._weights: _WeightIndex | _DequantizedIndex = weights if plan is None else _DequantizedIndex(weights, plan)
        if whole:
            resident_bytes = self._weights.elements() * self.dtype.itemsize
        # The head's cast blocks and modules (by path) kept on the device after their first use, within
        # `resident_bytes` (`_claim`); none by default, so memory stays one layer.
        self._resident: dict[str, Any] = {}
        self._resident_head: list[Any] | None = None
        self._spare = resident_bytes
        self._head_name = "lm_head.weight"
        if self._head_name not in self._weights:
            if not getattr(config, "tie_word_embeddings", False):
                raise StageFailed(
                    f"{self.model_dir}: no lm_head.weight and the config does not tie it to the embedding",
                    code=Codes.SOURCE_INVALID,
                )
            self._head_name = f"{self._prefix}embed_tokens.weight"
        # The head first: it is applied to every window (and every generated token), each layer once a call.
        vocab, hidden = self._weights.shape(self._head_name)
        self._keep_head = self._claim(vocab * hidden * self.dtype.itemsize)
        if getattr(self._model.lm_head, "bias", None) is not None:
            raise StageFailed(
                "an output head with a bias is not streamed", code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED
            )
        if quantizer is not None and any(
            hasattr(m, "quantization_scheme") for m in (model.lm_head, self._base.embed_tokens)
        ):
            raise StageFailed(
                "a quantized embedding or output head is not streamed", code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED
            )
        self._layer_types = list(
            getattr(config, "layer_types", None)
            or [("sliding_attention" if getattr(config, "sliding_window", None) else "full_attention")]
            * self.num_layers
        )
        if quantizer is not None:
            from kiln.quant.compressed import FP4_SCALE_DTYPES

            self._fp4 = getattr(quantizer.quantization_config.quantization_config, "format", None) in FP4_SCALE_DTYPES
        # The whole model's version: the same computation, whichever way the plan had the stage hold it.
        self._unquantized = not quantize_activations and quantizer is not None
        self.version = runtime_version(quantizer is not None, self._fp4, self._unquantized)
        held = Residency(whole=whole, resident_bytes=0 if whole else resident_bytes)
        weights_opened(checkpoint_bytes(self.model_dir), held.describe(), resident_bytes)

    # -- the Runtime protocol -------------------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return next(self.logits_many([token_ids]))

    def logits_many(self, windows: Sequence[Sequence[int]]) -> Iterator[np.ndarray]:
        """Each window's logits, float32 [len(window), vocab], in order: every layer runs over all windows
        (read once), then the head yields one window at a time."""
        checked = [check_ids(w, self.vocab_size, self.name) for w in windows]
        torch = self._torch
        with torch.inference_mode():
            hidden = [self._embed(ids)[None] for ids in checked]
            positions = [torch.arange(len(ids), device=self.device)[None] for ids in checked]
            masks = [self._masks(h, p, None) for h, p in zip(hidden, positions, strict=True)]
            rotary = [self._position_embeddings(h, p) for h, p in zip(hidden, positions, strict=True)]
            for i in range(self.num_layers):
                kind = self._layer_types[i]
                with self._loaded(f"{self._prefix}layers.{i}") as layer:
                    for w in range(len(hidden)):
                        hidden[w] = layer(
                            hidden[w],
                            attention_mask=masks[w][kind],
                            position_ids=positions[w],
                            position_embeddings=rotary[w][kind],
                        )
            with self._loaded(f"{self._prefix}norm") as norm:
                hidden = [norm(h)[0] for h in hidden]
            for w in range(len(hidden)):
                h, hidden[w] = hidden[w], None  # type: ignore[call-overload]  # drop each window's states once used
                yield self._head(h).cpu().numpy()

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        return greedy_by_length(prompts, self.vocab_size, self.name, self._greedy_batch, n)

    def close(self) -> None:
        self._weights.close()
        self._resident.clear()
        self._resident_head = None
        self._model = self._base = None

    # -- one pass ---------------------------------------------------------------------------------------------

    def _greedy_batch(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """One prompt pass, then one token at a time on the KV cache, each pass over every layer in turn (the
        resident ones as kept, the others read again)."""
        torch = self._torch
        from transformers import DynamicCache

        generated: list[list[int]] = [[] for _ in prompts]
        if n <= 0:
            return generated
        cache = DynamicCache(config=self.config)
        with torch.inference_mode():
            step = [list(p) for p in prompts]
            start = 0
            for _ in range(n):
                length = len(step[0])
                h = torch.stack([self._embed(ids) for ids in step])
                pos = torch.arange(start, start + length, device=self.device)[None].expand(len(step), -1)
                masks, rotary = self._masks(h, pos, cache), self._position_embeddings(h, pos)
                for i in range(self.num_layers):
                    kind = self._layer_types[i]
                    with self._loaded(f"{self._prefix}layers.{i}") as layer:
                        h = layer(
                            h,
                            attention_mask=masks[kind],
                            position_ids=pos,
                            past_key_values=cache,
                            use_cache=True,
                            position_embeddings=rotary[kind],
                        )
                with self._loaded(f"{self._prefix}norm") as norm:
                    last = norm(h[:, -1])
                toks = torch.argmax(self._head(last)[:, : self.vocab_size], dim=-1).tolist()
                for row, tok in zip(generated, toks, strict=True):
                    row.append(int(tok))
                start += length
                step = [[int(t)] for t in toks]
        return generated

    def _masks(self, h: Any, positions: Any, cache: Any) -> dict[str, Any]:
        """The attention mask per layer type, as the architecture's own model forward builds it."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = {
            "config": self.config,
            "inputs_embeds": h,
            "attention_mask": None,
            "past_key_values": cache,
            "position_ids": positions,
        }
        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: makers[kind](**kwargs) for kind in set(self._layer_types)}

    def _position_embeddings(self, h: Any, positions: Any) -> dict[str, Any]:
        """The rotary embedding's (cos, sin) per layer type, as the architecture's own model forward builds it."""
        if self._rotary_by_type:
            return {kind: self._rotary(h, positions, kind) for kind in set(self._layer_types)}
        shared = self._rotary(h, positions)
        return dict.fromkeys(set(self._layer_types), shared)

    def _embed(self, ids: list[int]) -> Any:
        """[len(ids), hidden] in `dtype`: the embedding's rows gathered from the mapped file, cast after, and
        scaled where the architecture scales them (Gemma: by sqrt(hidden) in `dtype`, as its embedding does)."""
        rows = self._weights.rows(f"{self._prefix}embed_tokens.weight", ids).to(device=self.device, dtype=self.dtype)
        if self._embed_scale is None:
            return rows
        return rows * self._torch.tensor(self._embed_scale, dtype=self.dtype, device=self.device)

    def _head(self, h: Any) -> Any:
        """[tokens, vocab] float32 logits of final hidden states `h`, HEAD_BLOCK vocabulary rows at a time,
        soft-capped in `dtype` where the architecture caps them (Gemma 3's `final_logit_softcapping`)."""
        torch = self._torch
        vocab, hidden = self._weights.shape(self._head_name)
        out = torch.empty((h.shape[0], vocab), dtype=torch.float32, device=self.device)
        kept = self._resident_head
        if kept is None and self._keep_head:
            kept = self._resident_head = []
        for i, lo in enumerate(range(0, vocab, HEAD_BLOCK)):
            hi = min(vocab, lo + HEAD_BLOCK)
            if kept is not None and i < len(kept):
                block = kept[i]
            else:
                block = self._weights.block(self._head_name, lo, hi).to(device=self.device, dtype=self.dtype)
                if kept is not None:
                    kept.append(block)
            logits = torch.nn.functional.linear(h, block)
            if self._softcap is not None:  # the order of Gemma3ForCausalLM.forward's three steps
                logits = torch.tanh(logits / self._softcap) * self._softcap
            out[:, lo:hi] = logits.float()
        return out

    @contextmanager
    def _loaded(self, path: str) -> Iterator[Any]:
        """The module at `path` ("model.layers.3") with its weights on the device while the block runs.

        Its checkpoint tensors (those named `path.`) go through transformers' loader
        (`convert_and_load_state_dict_in_model`) with the model's conversion mapping, as `from_pretrained`
        loads the whole model: renamed, experts fused, each cast to the dtype the module declares (a
        compressed tensor keeps its own). A bundle's module is a fresh copy of the compressed layout,
        decompressed once loaded (the layout is kept for the next load). On exit the weights are freed:
        the module keeps its shapes on the meta device, unless it is kept resident (`_claim`): then it is
        yielded as it is by every later call."""
        if path in self._resident:
            yield self._resident[path]
            return
        template = self._model.get_submodule(path)
        module = _copy_layer(template) if self._quantizer is not None else template
        declared = {name: t.dtype for name, t in template.state_dict().items()}
        self._model.set_submodule(path, module)
        kept = False
        try:
            self._read(path, module)
            as_declared(module, declared)
            if self._quantizer is not None:
                self._decompress(module)
            kept = self._claim(sum(t.nbytes for t in (*module.parameters(), *module.buffers())))
            yield module
        finally:
            if kept:
                self._resident[path] = module
            if module is not template:
                self._model.set_submodule(path, template)
            elif not kept:
                module.to("meta")

    def _claim(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit what may stay resident; if so they are counted as kept."""
        if nbytes > self._spare:
            return False
        self._spare -= nbytes
        return True

    def _read(self, path: str, module: Any) -> None:
        """Load the checkpoint's tensors under `path.` into `module` (installed at `path`) with transformers'
        loader, or fail naming what the checkpoint lacks or what did not convert."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        prefix = path + "."
        stored = {name: self._weights.tensor(name) for name in self._weights.names(prefix)}
        _read_fnuz_as_fn(stored)
        load = LoadStateDictConfig(
            dtype=self.dtype,
            dtype_plan=self._model._get_dtype_plan(self.dtype),
            hf_quantizer=self._quantizer,
            weight_mapping=self._conversions,  # type: ignore[arg-type]  # its own function's list
            device_map={"": str(self.device)},
        )
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its "Loading weights" bar, once per layer per pass
        try:
            info, _ = convert_and_load_state_dict_in_model(self._model, stored, load)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        failed = sorted(k for k in info.conversion_errors if k.startswith(prefix))
        if failed:
            raise StageFailed(
                f"{self.model_dir}: the checkpoint's tensors for {failed[0]} do not convert: "
                + " ".join(info.conversion_errors[failed[0]].strip().splitlines()[-2:])[:400],
                code=Codes.SOURCE_INVALID,
                details={"failed": failed[:8]},
            )
        mismatched = sorted((k, tuple(a), tuple(b)) for k, a, b in info.mismatched_keys if k.startswith(prefix))
        if mismatched:
            name, got, want = mismatched[0]
            raise StageFailed(
                f"{self.model_dir}: {name} is {list(got)} in the checkpoint, the model's is {list(want)}",
                code=Codes.SOURCE_INVALID,
                details={"mismatched": [m[0] for m in mismatched[:8]]},
            )
        missing = sorted(k for k in info.missing_keys if k.startswith(prefix))
        if missing:
            raise StageFailed(
                f"{self.model_dir}: the checkpoint lacks {missing[0]} ({len(missing)} tensors missing)",
                code=Codes.SOURCE_INVALID,
                details={"missing": missing[:8]},
            )
        unsaved = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if unsaved:  # a computed buffer would be left uninitialised by loading weights alone
            raise StageFailed(
                f"a layer holds tensors the checkpoint does not: {unsaved[:4]}",
                code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
            )

    def _decompress(self, module: Any) -> None:
        """compressed-tensors' own decompression of each quantized Linear of a loaded bundle layer."""
        from compressed_tensors.compressors.base import decompress_module
        from compressed_tensors.quantization.utils.helpers import is_module_quantized

        from kiln.eval.runtimes.transformers_runtime import leave_activations, upcast_linear_weights

        fmt = self._quantizer.compressor.force_compression_format
        for sub in module.modules():
            if is_module_quantized(sub):
                decompress_module(sub, fmt)
        if self._fp4:  # FP4 decompresses into bfloat16: upcast, as the whole-model load does
            upcast_linear_weights(module, self.dtype)
        if self._unquantized:
            leave_activations(module)


def _copy_layer(module: Any) -> Any:
    """A deep copy of a layer's compressed layout. compressed-tensors' quantized KV cache (an FP8 KV cache's
    `kv_cache` submodule of each attention) holds a weak reference to its attention module, which a deep copy
    keeps pointing at the original (on the meta device): it is pointed at the copy's own."""
    import weakref

    from compressed_tensors.modeling.kvcache import KV_CACHE_ATTR

    copied = copy.deepcopy(module)
    for sub in copied.modules():
        cache = getattr(sub, KV_CACHE_ATTR, None)
        if cache is not None and hasattr(cache, "attn_module"):
            cache.attn_module = weakref.ref(sub)
    return copied


def _read_fnuz_as_fn(stored: dict[str, Any]) -> None:
    """float8_e4m3fnuz weights (a rocm-bundle's) as e4m3fn with their scales halved, in place: every
    weight x scale product unchanged, and nothing rounded on the way into e4m3fn parameters."""
    import torch

    for name in [k for k, t in stored.items() if t.dtype == torch.float8_e4m3fnuz]:
        scale = name + "_scale"
        if scale not in stored:
            raise StageFailed(f"an e4m3fnuz tensor without its scale: {name}", code=Codes.SOURCE_INVALID)
        from kiln.targets.rocm_bundle.fnuz import e4m3fnuz_to_e4m3fn

        stored[name], stored[scale] = e4m3fnuz_to_e4m3fn(stored[name], stored[scale])


def open_transformers(
    model_dir: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    *,
    residency: Residency = WHOLE,
    quantize_activations: bool = True,
) -> TransformersRuntime | LayerStream:
    """The transformers runtime for a model directory, holding it as the plan decided (`residency`,
    `eval.runtimes.residency.hold`): the whole model, or one layer at a time (an architecture of
    `STREAMED_MODEL_TYPES`, a plain checkpoint or a compressed-tensors bundle, in a given dtype) keeping
    `resident_bytes` of cast layers; the same logits, bit for bit (tests/eval/test_layer_stream.py). A
    pre-quantized source is the layer stream, dequantizing as it reads, keeping every layer when whole; one of a
    family that does not stream (DeepSeek-V3, gpt-oss), the whole model, its tensors dequantized as they load."""
    config = Path(model_dir) / "config.json"
    try:
        declared = json.loads(config.read_text())
        model_type = declared.get("model_type")
    except (OSError, ValueError, AttributeError):
        declared, model_type = {}, None  # LayerStream says what is wrong with it
    prequantized = isinstance(declared, dict) and declares_prequantized(declared)
    if residency.whole and not prequantized:
        return TransformersRuntime(model_dir, dtype, device, quantize_activations=quantize_activations)  # type: ignore[arg-type]
    if prequantized and dtype == "auto":
        raise StageFailed(
            f"{str(model_dir)!r} is a pre-quantized source, read dequantized into a given dtype, not 'auto'",
            code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
            details={"model_type": model_type, "dtype": dtype},
        )
    if prequantized and model_type not in STREAMED_MODEL_TYPES:
        if not residency.whole:  # the plan holds a family that does not stream whole (`residency.hold`)
            raise StageFailed(
                f"planned to stream {str(model_dir)!r} by layer, which covers {sorted(STREAMED_MODEL_TYPES)}, not "
                f"{model_type!r}",
                code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
                details={"model_type": model_type, "dtype": dtype},
            )
        # Held whole, dequantized as transformers' loader reads each tensor.
        return TransformersRuntime(model_dir, dtype, device, prequantized=quantized_plan(model_dir))  # type: ignore[arg-type]
    if model_type is not None and model_type not in STREAMED_MODEL_TYPES or dtype == "auto":
        raise StageFailed(
            f"planned to stream {str(model_dir)!r} by layer, which covers {sorted(STREAMED_MODEL_TYPES)} in a "
            f"given dtype, not {model_type!r} in {dtype!r}",
            code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
            details={"model_type": model_type, "dtype": dtype},
        )
    return LayerStream(
        model_dir,
        dtype,
        device,
        resident_bytes=residency.resident_bytes,
        whole=residency.whole,
        quantize_activations=quantize_activations,
    )


class _WeightIndex:
    """Where each tensor of a SafeTensors directory lives, read through safetensors' mapped handles."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self._where: dict[str, Path] = {}
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            self._where = {str(k): model_dir / str(v) for k, v in weight_map.items()}
        else:
            for f in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                        self._where[name] = f
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self, prefix: str) -> list[str]:
        """The tensors whose names start with `prefix` (one module's: "model.layers.3.")."""
        return [name for name in self._where if name.startswith(prefix)]

    def _handle(self, name: str) -> Any:
        path = self._where[name]
        if path not in self._handles:
            self._handles[path] = self._open(str(path), framework="pt")
        return self._handles[path]

    def tensor(self, name: str) -> Any:
        tensor = self._handle(name).get_tensor(name)
        weights_read(tensor.nbytes)
        return tensor

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def elements(self) -> int:
        """Every tensor's elements (what the model holds cast)."""
        return sum(math.prod(self.shape(name)) for name in self._where)

    def block(self, name: str, lo: int, hi: int) -> Any:
        """Rows lo..hi of a 2-D tensor, read alone."""
        rows = self._handle(name).get_slice(name)[lo:hi]
        weights_read(rows.nbytes)
        return rows

    def rows(self, name: str, ids: Sequence[int]) -> Any:
        """The rows `ids` of a 2-D tensor, each read alone (an embedding lookup without the table)."""
        import torch

        table = self._handle(name).get_slice(name)
        rows = torch.cat([table[i : i + 1] for i in ids])
        weights_read(rows.nbytes)
        return rows

    def close(self) -> None:
        self._handles.clear()


class _DequantizedIndex:
    """A pre-quantized source's tensors by their released names: each quantized one dequantized into float32 as
    it is read (`formats.prequantized.dequantize`, its scales and values checked), every other as stored."""

    def __init__(self, index: _WeightIndex, plan: QuantizedPlan) -> None:
        self._index, self._plan = index, plan
        self._parts = plan.stored_names

    def __contains__(self, name: str) -> bool:
        return name in self._plan.tensors or (name in self._index and name not in self._parts)

    def names(self, prefix: str) -> list[str]:
        plain = [n for n in self._index.names(prefix) if n not in self._parts]
        return plain + [n for n in self._plan.tensors if n.startswith(prefix)]

    def tensor(self, name: str) -> Any:
        qt = self._plan.tensors.get(name)
        if qt is None:
            return self._index.tensor(name)
        values, scale = self._index.tensor(qt.values.name), self._index.tensor(qt.scale.name)
        return dequantize(self._plan.quantization, qt, values, scale)

    def shape(self, name: str) -> list[int]:
        qt = self._plan.tensors.get(name)
        return list(qt.shape) if qt is not None else self._index.shape(name)

    def elements(self) -> int:
        stored = sum(math.prod(p.shape) for qt in self._plan.tensors.values() for p in qt.parts)
        return self._index.elements() - stored + sum(qt.numel for qt in self._plan.tensors.values())

    def block(self, name: str, lo: int, hi: int) -> Any:
        self._plain(name)
        return self._index.block(name, lo, hi)

    def rows(self, name: str, ids: Sequence[int]) -> Any:
        self._plain(name)
        return self._index.rows(name, ids)

    def _plain(self, name: str) -> None:
        if name in self._plan.tensors:  # no release quantizes them (modules_to_not_convert)
            raise StageFailed(
                f"{name} is stored {self._plan.quantization.layout.name}: a quantized embedding or output head is "
                "not streamed",
                code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
            )

    def close(self) -> None:
        self._index.close()
