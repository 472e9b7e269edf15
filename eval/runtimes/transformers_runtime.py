"""transformers on the stage's device: the reference, and the runtime of the hf-bundle target.

As the reference it loads the source release's bf16 SafeTensors and upcasts them to float32, so
every matmul runs in float32: the reference is the checkpoint's exact weights with as little
rounding in the arithmetic as this machine offers. For an hf-bundle artifact it loads the bundle
directory the same way (`dtype="auto"` keeps the checkpoint's dtype, e.g. for quantized bundles
whose kernels need it); gpt-oss's MXFP4 release layout with its experts dequantized at load (`released_mxfp4`).
A compressed-tensors bundle's experts load as one quantized Linear per expert
projection (`eval.runtimes.experts`: transformers alone would dequantize them into its fused experts),
and tensors its loader renamed keep the dtype the model declares (`as_declared`).

A pre-quantized source (FP8 block, MXFP4 experts: `formats.prequantized`) of a family the layer stream does not
cover (`Architecture.streams` False: DeepSeek-V3, gpt-oss) is held whole here: its model built plain (config.json
without `quantization_config`, so none of transformers' FP8 or MXFP4 kernels run) and loaded by transformers'
own loader from its tensors as released, each quantized one dequantized into float32 only when the loader
reaches it (`dequantized` names the layout; the reference stage records it).

`device` is a torch device string (`cpu`, `cuda:0`; the stage's, `pipeline.placement`). On a CUDA
device the model is moved there after loading; each window's ids go there and its logits come back
as float32 numpy, one window at a time. float32 matmuls on CUDA stay IEEE float32 (torch's default:
TF32 off), so a float32 reference on a GPU differs from the CPU's only by summation order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kiln.core.error_codes import Codes
from kiln.core.errors import Deferred, InvalidInput, StageFailed
from kiln.core.usage import weights_opened, weights_read
from kiln.eval.runtimes.base import check_ids, checkpoint_bytes, greedy_by_length, import_torch_transformers
from kiln.eval.runtimes.experts import loading_experts
from kiln.formats.prequantized import QuantizedPlan, dequantize

TorchDtype = Literal["float32", "bfloat16", "float16", "auto"]


class TransformersRuntime:
    """`AutoModelForCausalLM` from a model directory, run under `torch.inference_mode` on `device`."""

    name = "transformers"

    def __init__(
        self,
        model_dir: str | Path,
        dtype: TorchDtype = "float32",
        device: str = "cpu",
        *,
        prequantized: QuantizedPlan | None = None,
        quantize_activations: bool = True,
    ) -> None:
        """`prequantized`: the source's quantized tensors (`formats.hf_model.quantized_plan`), read dequantized.
        `quantize_activations` False: a bundle's Linears take their inputs as the reference does
        (`leave_activations`)."""
        torch, transformers = import_torch_transformers()
        if dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise InvalidInput(f"dtype must be float32, bfloat16, float16 or auto, got {dtype!r}")
        self._torch = torch
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)  # a malformed string raises here, before the model loads
        torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype)
        # The layout a pre-quantized source is read dequantized from (None: a plain checkpoint or a bundle).
        self.dequantized: str | None = prequantized.quantization.layout.name if prequantized is not None else None
        if prequantized is not None and dtype == "auto":
            raise InvalidInput("a pre-quantized source is read dequantized into a given dtype, not 'auto'")
        try:
            config = transformers.AutoConfig.from_pretrained(str(self.model_dir))
            if prequantized is not None:
                del config.quantization_config  # built plain: its weights are the dequantized ones
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

                with _ReleasedTensors(self.model_dir, prequantized) as released:
                    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
                    model, info = model_class.from_pretrained(
                        None,
                        config=config,
                        state_dict=released.state_dict(),
                        dtype=torch_dtype,
                        output_loading_info=True,
                    )
                _check_loaded(self.model_dir, info)
            elif released_mxfp4(config):
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(self.model_dir),
                    dtype=torch_dtype,
                    quantization_config=transformers.Mxfp4Config(dequantize=True),
                )
                if dtype != "auto":  # the experts come out bfloat16 whatever the dtype: upcast (exact)
                    as_declared(model, {name: torch_dtype for name, _ in model.named_parameters()})
            else:
                with loading_experts(config):  # a bundle's experts as one quantized Linear each (eval.runtimes.experts)
                    model = transformers.AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch_dtype)
                    if dtype != "auto" and getattr(model, "hf_quantizer", None) is not None:
                        as_declared(model, declared_dtypes(config, self.model_dir, torch_dtype))
        except ImportError as e:  # e.g. a quantized bundle whose kernels package is missing here
            raise Deferred(
                f"transformers cannot load {str(self.model_dir)!r} on this machine: {e}",
                details={
                    "runtime_needed": f"transformers with {getattr(e, 'name', None) or 'its quantization backend'}"
                },
            ) from None
        except (OSError, ValueError, KeyError) as e:
            raise StageFailed(
                f"transformers could not load {str(self.model_dir)!r}: {e}",
                code=Codes.EVAL_RUNTIME_LOAD_FAILED,
                details={"runtime": self.name, "path": str(self.model_dir)},
            ) from None
        _load_e4m3fnuz_exactly(model, self.model_dir)
        loaded = checkpoint_bytes(self.model_dir)  # read once, whole (`core.usage.WeightReads`)
        weights_opened(loaded, "whole")
        weights_read(loaded)
        emulated = dtype != "auto" and decompress_fp4(model, getattr(torch, dtype))
        unquantized = not quantize_activations and leave_activations(model)
        if self.device.type != "cpu":
            model.to(self.device)  # type: ignore[arg-type]  # transformers types `to` as a dtype cast; it moves in place
        self._model: Any = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        self.version = runtime_version(getattr(model, "hf_quantizer", None) is not None, emulated, unquantized)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = check_ids(token_ids, self.vocab_size, self.name)
        torch = self._torch
        with torch.inference_mode():
            out = self._model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device), use_cache=False)
        return np.ascontiguousarray(out.logits[0].float().cpu().numpy(), dtype=np.float32)

    def logits_many(self, windows: Sequence[Sequence[int]]) -> Iterator[np.ndarray]:
        """Each window's logits, in order (`LayerStream.logits_many`'s call, on the model held whole)."""
        return (self.logits(w) for w in windows)

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        return greedy_by_length(prompts, self.vocab_size, self.name, self._greedy_batch, n)

    def _greedy_batch(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        torch = self._torch
        generated: list[list[int]] = [[] for _ in prompts]
        if n <= 0:
            return generated
        with torch.inference_mode():
            # One prompt pass, then one token at a time on the KV cache: how a server decodes.
            out = self._model(input_ids=torch.tensor(prompts, dtype=torch.long, device=self.device), use_cache=True)
            for i in range(n):
                toks = torch.argmax(out.logits[:, -1, : self.vocab_size], dim=-1)
                for row, tok in zip(generated, toks.tolist(), strict=True):
                    row.append(int(tok))
                if i + 1 < n:
                    out = self._model(input_ids=toks[:, None], past_key_values=out.past_key_values, use_cache=True)
        return generated

    def close(self) -> None:
        self._model = None


# What an FP4 bundle's eval here is: not the serving kernel (Blackwell / gfx950 FP4 matmuls, Marlin FP4).
FP4_EMULATED = ", FP4 emulated (weights decompressed by compressed-tensors, activations fake-quantized)"


# What a bundle of a release's own quantized weights is evaluated with (`leave_activations`).
ACTIVATIONS_AS_REFERENCE = (
    ", activations unquantized as in the reference (the weights are the release's own, its activation scheme too)"
)


def released_mxfp4(config: Any) -> bool:
    """Whether a bundle is gpt-oss's MXFP4 release layout (`quant_method: mxfp4`, the catalog's mxfp4-experts).

    transformers 5.17's `Mxfp4HfQuantizer` runs its experts with the `kernels` package's Triton kernels where those
    and triton are installed, and dequantizes them into bfloat16 where not; kiln asks for the latter everywhere
    (`Mxfp4Config(dequantize=True)`), so every machine computes the release's values, E2M1 times a power of two,
    which bfloat16 holds exactly, and the eval upcasts them to its dtype."""
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method)) == "mxfp4"


def leave_activations(model: Any) -> bool:
    """Let a compressed-tensors bundle's Linears take their inputs unquantized, as the reference computes them;
    returns whether any quantized one was there. For an artifact that keeps a release's own quantized weights
    (fp8-block from an FP8-block release): the release's dynamic FP8 activations are its own scheme, which the
    reference of the release, computed from its dequantized weights, leaves out, so the eval compares the weights
    alone, and KL ~ 0 says they are the release's. The weights stay as compressed-tensors decompressed them."""
    changed = False
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_enabled = False
            changed = True
    return changed


def runtime_version(compressed: bool, fp4: bool, activations_unquantized: bool = False) -> str:
    """What the transformers forward records as its version, held whole or streamed by layer alike: transformers
    and torch, compressed-tensors for a compressed-tensors bundle, FP4's emulation, and activations left
    unquantized (`leave_activations`)."""
    import torch
    import transformers

    version = f"transformers {transformers.__version__}, torch {torch.__version__}"
    if compressed:
        import compressed_tensors

        version += f", compressed-tensors {compressed_tensors.__version__}"
    return version + (FP4_EMULATED if fp4 else "") + (ACTIVATIONS_AS_REFERENCE if activations_unquantized else "")


def decompress_fp4(model: Any, dtype: Any) -> bool:
    """Decompress an FP4 bundle (NVFP4, MXFP4) now, into `dtype`.

    transformers leaves compressed-tensors bundles compressed and decompresses them on the first forward,
    FP4 into bfloat16 whatever the model's dtype, which a float32 forward then refuses. Here they are
    decompressed at load and each weight upcast (exact: every bf16 is a float32); the forward then
    fake-quantizes the weight against its own scales, in `dtype`, as compressed-tensors does for any
    decompressed layer. Other bundles are left as transformers loads them. Returns whether it was FP4."""
    from kiln.quant.compressed import FP4_SCALE_DTYPES

    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(getattr(quantizer, "quantization_config", None), "quantization_config", None)
    if quantizer is None or config is None or getattr(config, "format", None) not in FP4_SCALE_DTYPES:
        return False
    quantizer.compressor.decompress_model(model=model)
    upcast_linear_weights(model, dtype)
    return True


def upcast_linear_weights(model: Any, dtype: Any) -> None:
    """Give every Linear weight of `model` the forward's `dtype` (decompressed FP4 comes out bfloat16)."""
    import torch

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor) and weight.dtype != dtype:
            # Removed, then a new Parameter: compressed-tensors' offload cache copies a same-shaped value into
            # the tensor it holds (keeping its dtype), and hands out copies, so `.data` is no way in either.
            upcast = torch.nn.Parameter(weight.data.to(dtype), requires_grad=False)
            delattr(module, "weight")
            module.weight = upcast


def compressed_tensors_quantizer(config: Any, model_dir: Path) -> Any:
    """transformers' quantizer for a compressed-tensors bundle's config (None for a plain checkpoint), set to
    the emulation every CPU and GPU computes alike; a quantization another library wrote is refused."""
    if getattr(config, "quantization_config", None) is None:
        return None
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer

    try:
        quantizer = AutoHfQuantizer.from_config(config.quantization_config)
    except (ValueError, KeyError, TypeError) as e:  # an unknown method, or a config its library refuses
        raise StageFailed(
            f"{model_dir}: config.json's quantization_config is not one transformers loads: {e}",
            code=Codes.EVAL_RUNTIME_LOAD_FAILED,
            details={"path": str(model_dir), "field": "quantization_config"},
        ) from None
    if not isinstance(quantizer, CompressedTensorsHfQuantizer):
        raise StageFailed(
            f"{model_dir}: {type(quantizer).__name__} quantization is not streamed (compressed-tensors is)",
            code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
        )
    try:
        quantizer.validate_environment()
    except ImportError as e:  # its quantization library is not installed here
        raise Deferred(
            f"transformers cannot load {str(model_dir)!r} on this machine: {e}",
            details={"runtime_needed": "transformers with compressed-tensors"},
        ) from None
    quantizer.use_fp8_kernel = False
    return quantizer


def declared_dtypes(config: Any, model_dir: Path, dtype: Any) -> dict[str, Any]:
    """Each parameter's dtype as a bundle's model declares it before loading: built on the meta device in
    `dtype`, each quantized Linear in its compressed layout (transformers' quantizer, as `from_pretrained`)."""
    import torch
    import transformers

    with torch.device("meta"):
        twin = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    quantizer = compressed_tensors_quantizer(config, model_dir)
    if quantizer is not None:
        quantizer._process_model_before_weight_loading(twin)
    return {name: p.dtype for name, p in twin.named_parameters()}


def as_declared(model: Any, declared: dict[str, Any]) -> None:
    """Give each floating-point parameter of a loaded bundle the dtype its model declares where the load left
    the checkpoint's, narrower one (an exact upcast).

    transformers 5.17 loads a pre-quantized checkpoint's tensors in the model's dtype, except those whose name
    its conversion mapping renames, which keep the checkpoint's (`core_model_loading.
    convert_and_load_state_dict_in_model`: `original_key != renamed_key` -> `_dtype = None`). Mixtral's
    `block_sparse_moe.` -> `mlp.` renames its router and experts: a float32 load of a Mixtral bundle kept the
    router bfloat16 (its matmul then refuses the float32 activations) and the experts' scales bfloat16 (their
    weights dequantized in bfloat16, the attention's in float32)."""
    import torch

    for name, param in list(model.named_parameters()):
        want = declared.get(name)
        if (
            want is None
            or not param.is_floating_point()
            or not want.is_floating_point
            or param.dtype == want
            or torch.finfo(want).bits <= torch.finfo(param.dtype).bits
        ):
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        delattr(module, attr)  # removed, then a new Parameter (as `upcast_linear_weights`)
        setattr(module, attr, torch.nn.Parameter(param.data.to(want), requires_grad=False))


class _ReleasedTensors:
    """A pre-quantized source's tensors by their released names, for transformers' loader: plain ones as its own
    lazy SafeTensors slices, each quantized one as `_Dequantized`, read and dequantized when the loader gets to
    it, so the loader holds one dequantized tensor beside the model it fills, never the whole source twice."""

    def __init__(self, model_dir: Path, plan: QuantizedPlan) -> None:
        self._dir, self._plan = model_dir, plan
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}

    def __enter__(self) -> _ReleasedTensors:
        from safetensors import safe_open

        for f in sorted(self._dir.glob("*.safetensors")):
            handle = safe_open(str(f), framework="pt")
            self._handles[f] = handle
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._where[name] = f
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()

    def tensor(self, name: str) -> Any:
        return self._handles[self._where[name]].get_tensor(name)

    def state_dict(self) -> dict[str, Any]:
        parts = self._plan.stored_names
        out: dict[str, Any] = {n: self._handles[f].get_slice(n) for n, f in self._where.items() if n not in parts}
        for name in self._plan.tensors:
            out[name] = _Dequantized(self, self._plan, name)
        return out


class _Dequantized:
    """One quantized tensor as transformers' loader reads a lazy slice (`tensor[...]`): dequantized in float32
    when read (`formats.prequantized.dequantize`, its scales and values checked first)."""

    def __init__(self, released: _ReleasedTensors, plan: QuantizedPlan, name: str) -> None:
        self._released, self._plan, self._name = released, plan, name

    def __getitem__(self, key: object) -> Any:
        if key is not Ellipsis:
            raise TypeError(f"{self._name} is read whole (dequantized), not sliced by {key!r}")
        qt = self._plan.tensors[self._name]
        values, scale = self._released.tensor(qt.values.name), self._released.tensor(qt.scale.name)
        return dequantize(self._plan.quantization, qt, values, scale)


def _check_loaded(model_dir: Path, info: dict[str, Any]) -> None:
    """A model loaded from a dequantized state dict holds every tensor it declares, of its shape: a tensor the
    loader left initialised at random would be scored as if it were the release's."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(info.get("mismatched_keys") or [])
    errors = info.get("conversion_errors") or {}
    if missing or mismatched or errors:
        first = (missing or [m[0] for m in mismatched] or sorted(errors))[0]
        raise StageFailed(
            f"{model_dir}: the dequantized source does not load whole into its model: {first} "
            f"({len(missing)} missing, {len(mismatched)} of another shape, {len(errors)} not converted)",
            code=Codes.SOURCE_INVALID,
            details={"missing": missing[:8], "mismatched": [m[0] for m in mismatched[:8]]},
        )


def _load_e4m3fnuz_exactly(model: Any, model_dir: Path) -> None:
    """Put a bundle's float8_e4m3fnuz weights (rocm-bundle for gfx942) into the model without rounding.

    transformers copies them by value into compressed-tensors' float8_e4m3fn parameters, which rounds
    e4m3fnuz's smallest subnormals; reading the same bits as e4m3fn with the scale halved keeps every
    weight x scale product exact, so the eval scores the values the bundle holds.
    """
    from safetensors import safe_open
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    from kiln.targets.rocm_bundle.fnuz import e4m3fnuz_to_e4m3fn

    # The checkpoint's names as the load renamed them (Mixtral's `block_sparse_moe.` is the module's `mlp.`).
    renamings = [t for t in getattr(model, "_weight_conversions", None) or [] if isinstance(t, WeightRenaming)]
    files = sorted(model_dir.glob("*.safetensors"))
    where: dict[str, Path] = {}
    fnuz: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                where[name] = f
                if handle.get_slice(name).get_dtype() == "F8_E4M3FNUZ":
                    fnuz.append(name)
    for name in fnuz:
        with safe_open(str(where[name]), framework="pt") as handle:
            weight = handle.get_tensor(name)
        with safe_open(str(where[name + "_scale"]), framework="pt") as handle:
            scale = handle.get_tensor(name + "_scale")
        fn, halved = e4m3fnuz_to_e4m3fn(weight, scale)
        module = model.get_submodule(rename_source_key(name, renamings, [])[0].removesuffix(".weight"))
        module.weight.data.copy_(fn)
        module.weight_scale.data.copy_(halved.to(module.weight_scale.dtype))
