"""W8A8 bundles through the matmul kernels a GPU serves them with, compared with kiln's emulation of them.

kiln evaluates an hf-bundle in transformers, which (with compressed-tensors) dequantizes the FP8 or
int8 weights and fake-quantizes the activations: an emulation of what vLLM computes on a GPU. This
module runs the same bundle through the real low-precision matmuls instead, one per quantized Linear:

| scheme | activations (dynamic) | weights | kernel on CUDA |
|---|---|---|---|
| `fp8` | e4m3fn per token (absmax / 448) | e4m3fn per output channel | `torch._scaled_mm`, row-wise scales |
| `fp8-block` | e4m3fn per token and 128 columns | e4m3fn per 128x128 block | `torch._scaled_mm`, block-wise |
| `int8-w8a8` | int8 per token (absmax / 127) | int8 per output channel | `torch._int_mm`, then both scales |

and reports the mean KL divergence, top-1 agreement and largest logit difference of those logits
against the bundle's logits in kiln's own eval runtime (`TransformersRuntime` of the bundle, on the
CPU). Every other module (embeddings, norms, attention, the bf16 `lm_head`) is the bundle's own,
in bf16, on the same device.

`kernels="emulated"` replaces each kernel by its float32 emulation (dequantize both operands,
multiply in float32, apply the same rounding to bf16): the stand-in that runs on any device, so the
whole path (reading the bundle, quantizing activations, the swap of every Linear) is exercised on a
CPU; `kernels="native"` needs CUDA (sm89+ for FP8). A kernel that this torch or GPU lacks (block-wise
scaled_mm before cuBLAS supports it) raises `KernelUnavailable`, naming what was tried.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from core.errors import InvalidInput, KilnError

if TYPE_CHECKING:
    import torch

Kernels = Literal["native", "emulated"]
E4M3_MAX = 448.0
INT8_MAX = 127.0
BLOCK = 128
NATIVE_SCHEMES = ("fp8", "fp8-block", "int8-w8a8")


class KernelUnavailable(KilnError):
    """This torch or device has no kernel for the scheme's matmul."""

    code = "KERNEL_UNAVAILABLE"


@dataclass(frozen=True)
class KernelCheck:
    """One bundle through one set of kernels, against kiln's emulation of it."""

    scheme: str
    device: str
    kernels: Kernels
    kernel: str  # the matmul that ran, e.g. "torch._scaled_mm (row-wise)"
    linears: int  # quantized Linears swapped for the kernel
    windows: int
    tokens: int
    kl: float  # mean KL(emulation || kernels) over every scored position
    top1: float  # top-1 agreement with the emulation
    max_abs_diff: float  # largest |logit difference|
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _quantize_rows(x: torch.Tensor, groups: int, qmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] quantized with one scale per row and `K / groups` columns: (q [N, K], scales [N, groups] f32)."""
    import torch

    xf = x.float().unflatten(-1, (groups, -1))
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-12)
    q = (xf / scale).clamp(-qmax, qmax)
    q = q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return q.flatten(-2), scale.squeeze(-1)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


class _Kernel:
    """One scheme's matmul, native or emulated: `y[N, O] = dequant(quant(x)) @ dequant(w)^T`, in bf16."""

    def __init__(self, scheme: str, kernels: Kernels, device: torch.device) -> None:
        self.scheme = scheme
        self.kernels = kernels
        self.name = "float32 emulation" if kernels == "emulated" else ""
        self._block_call: Callable[..., torch.Tensor] | None = None
        if kernels == "native":
            if device.type != "cuda":
                raise KernelUnavailable(f"native {scheme} kernels need a CUDA device, not {device}")
            self.name = {
                "fp8": "torch._scaled_mm (row-wise)",
                "int8-w8a8": "torch._int_mm",
                "fp8-block": "",
            }[scheme]
            if scheme == "fp8-block":
                self._block_call, self.name = _blockwise_scaled_mm(device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        import torch

        rows, cols = w.shape
        if self.scheme == "fp8":
            xq, xs = _quantize_rows(x, 1, E4M3_MAX, torch.float8_e4m3fn)
            if self.kernels == "native":
                return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.reshape(1, -1), out_dtype=torch.bfloat16)
            return ((xq.float() * xs) @ (w.float() * w_scale).t()).to(torch.bfloat16)
        if self.scheme == "int8-w8a8":
            xq, xs = _quantize_rows(x, 1, INT8_MAX, torch.int8)
            if self.kernels == "native":
                try:
                    acc = torch._int_mm(xq, w.t()).float()
                except RuntimeError:  # a build whose cuBLASLt wants the second operand row-major
                    acc = torch._int_mm(xq, w.t().contiguous()).float()
            else:
                acc = xq.float() @ w.float().t()  # exact: int8 products summed in float32 below 2^24
            return (acc * xs * w_scale.reshape(1, -1)).to(torch.bfloat16)
        # fp8-block: activations per token and 128 columns, weights per 128x128 block
        xq, xs = _quantize_rows(x, cols // BLOCK, E4M3_MAX, torch.float8_e4m3fn)
        if self._block_call is not None:
            return self._block_call(xq, xs, w, w_scale)
        xd = xq.float() * xs.repeat_interleave(BLOCK, 1)
        wd = w.float() * _expand_blocks(w_scale, rows, cols)
        return (xd @ wd.t()).to(torch.bfloat16)


def _blockwise_scaled_mm(device: torch.device) -> tuple[Callable[..., torch.Tensor], str]:
    """A block-scaled FP8 matmul this torch and GPU run correctly, found by trying the known call forms on
    a small product and checking each against its float32 emulation; KernelUnavailable if none does."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    n, k, o = 32, 2 * BLOCK, 2 * BLOCK
    x = torch.randn(n, k, generator=g).to(device)
    w = (torch.randn(o, k, generator=g) / 16).to(device)
    xq, xs = _quantize_rows(x, k // BLOCK, E4M3_MAX, torch.float8_e4m3fn)
    ws = (w.abs().unflatten(1, (-1, BLOCK)).unflatten(0, (-1, BLOCK)).amax(dim=(1, 3)) / E4M3_MAX).float()
    wq = (w / _expand_blocks(ws, o, k)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    want = (xq.float() * xs.repeat_interleave(BLOCK, 1)) @ (wq.float() * _expand_blocks(ws, o, k)).t()

    def functional(xq: Any, xs: Any, wq: Any, ws: Any) -> Any:
        from torch.nn.functional import ScalingType, SwizzleType  # type: ignore[attr-defined]

        return torch.nn.functional.scaled_mm(  # type: ignore[attr-defined]
            xq,
            wq.t(),
            xs.t().contiguous().t(),
            ScalingType.BlockWise1x128,
            ws,
            ScalingType.BlockWise128x128,
            swizzle_a=SwizzleType.NO_SWIZZLE,
            swizzle_b=SwizzleType.NO_SWIZZLE,
            output_dtype=torch.bfloat16,
        )

    def private(xq: Any, xs: Any, wq: Any, ws: Any) -> Any:
        # cuBLAS's block scaling: the 1x128 activation scales M-major (outer-dim-major), the weights' as given.
        return torch._scaled_mm(
            xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t().contiguous(), out_dtype=torch.bfloat16
        )

    def private_plain(xq: Any, xs: Any, wq: Any, ws: Any) -> Any:
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    tried = []
    for name, call in (
        ("torch.nn.functional.scaled_mm (BlockWise1x128 x BlockWise128x128)", functional),
        ("torch._scaled_mm (block-wise 1x128 x 128x128 scales)", private),
        ("torch._scaled_mm (block-wise scales, as stored)", private_plain),
    ):
        try:
            got = call(xq, xs, wq, ws).float()
        except Exception as e:  # an unsupported form: the next one is tried
            tried.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            continue
        err = float((got - want).abs().max() / want.abs().max())
        if err < 2e-2:
            return call, name
        tried.append(f"{name}: ran but differs from the emulation by {err:.2e} of the largest value")
    raise KernelUnavailable(
        "no block-scaled FP8 matmul in this torch runs correctly on this device: " + "; ".join(tried),
        details={"tried": tried, "torch": torch.__version__},
    )


class _NativeLinear:
    """Build a torch module (lazily: torch is imported by the caller) for one quantized Linear."""

    @staticmethod
    def make(weight: torch.Tensor, scale: torch.Tensor, kernel: _Kernel) -> torch.nn.Module:
        import torch

        class NativeQuantLinear(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("weight_q", weight)
                self.register_buffer("weight_scale", scale.float())

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                shape = x.shape
                flat = x.reshape(-1, shape[-1])
                n = flat.shape[0]
                # The tensor-core kernels want whole tiles of rows (_int_mm: more than 16): pad with zero rows.
                padded = max(32, -(-n // 16) * 16)
                if padded != n:
                    flat = torch.cat([flat, flat.new_zeros(padded - n, flat.shape[1])])
                y = kernel(flat, self.get_buffer("weight_q"), self.get_buffer("weight_scale"))[:n]
                return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)

        return NativeQuantLinear()


def _bundle_scheme(bundle: Path) -> str:
    config = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
    qc = config.get("quantization_config") or {}
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise InvalidInput(f"{bundle}: not a one-scheme compressed-tensors bundle")
    (group,) = groups.values()
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if w.get("type") == "float" and w.get("strategy") == "channel" and a.get("type") == "float":
        return "fp8"
    if (
        w.get("type") == "float"
        and w.get("strategy") == "block"
        and list(w.get("block_structure") or [])
        == [
            BLOCK,
            BLOCK,
        ]
    ):
        return "fp8-block"
    if w.get("type") == "int" and w.get("num_bits") == 8 and w.get("strategy") == "channel" and a.get("type") == "int":
        return "int8-w8a8"
    raise InvalidInput(
        f"{bundle}: its quantization is none of {', '.join(NATIVE_SCHEMES)}", details={"known": list(NATIVE_SCHEMES)}
    )


def load_native(bundle: str | Path, device: str, kernels: Kernels = "native") -> tuple[Any, str, str, int]:
    """The bundle as a bf16 transformers model on `device` with every quantized Linear running `kernels`:
    (model, scheme, kernel name, Linears swapped)."""
    import torch
    import transformers
    from safetensors import safe_open

    bundle = Path(bundle)
    scheme = _bundle_scheme(bundle)
    dev = torch.device(device)
    kernel = _Kernel(scheme, kernels, dev)
    config = transformers.AutoConfig.from_pretrained(str(bundle))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # every weight loaded below
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(bundle.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                tensors[name] = handle.get_tensor(name)
    swapped = 0
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        module = name.removesuffix(".weight_scale")
        parent, _, child = module.rpartition(".")
        native = _NativeLinear.make(tensors.pop(f"{module}.weight").to(dev), tensors.pop(name).to(dev), kernel)
        setattr(model.get_submodule(parent), child, native)
        swapped += 1
    loaded = model.load_state_dict({k: v.to(torch.bfloat16) for k, v in tensors.items()}, strict=False)
    missing = [k for k in loaded.missing_keys if not k.endswith(("weight_q", "weight_scale"))]
    if getattr(config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or loaded.unexpected_keys:
        raise InvalidInput(
            f"{bundle}: tensors missing {missing[:5]}, unexpected {loaded.unexpected_keys[:5]}",
            details={"missing": missing, "unexpected": loaded.unexpected_keys},
        )
    model = model.to(dev)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.eval()
    return model, scheme, kernel.name, swapped


def check_kernels(
    bundle: str | Path, windows: Sequence[Sequence[int]], device: str, kernels: Kernels = "native"
) -> KernelCheck:
    """Logits of `bundle` through `kernels` on `device` against kiln's eval of it (transformers on the CPU)."""
    import torch

    from eval.metrics import MetricAccumulator
    from eval.runtimes.transformers_runtime import TransformersRuntime

    started = time.time()
    # As the eval stage opens an hf-bundle: transformers (compressed-tensors) on the CPU, in float32.
    emulation = TransformersRuntime(bundle, device="cpu")
    model, scheme, kernel_name, swapped = load_native(bundle, device, kernels)
    acc = MetricAccumulator(emulation.vocab_size)
    worst = 0.0
    tokens = 0
    try:
        for window in windows:
            ids = [int(t) for t in window]
            want = emulation.logits(ids)
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
            got = np.ascontiguousarray(out.logits[0].float().cpu().numpy(), dtype=np.float32)
            worst = max(worst, float(np.abs(got - want).max()))
            acc.add(want[:-1], got[:-1], ids[1:])
            tokens += len(ids) - 1
    finally:
        emulation.close()
    metrics = acc.result()
    return KernelCheck(
        scheme=scheme,
        device=str(device),
        kernels=kernels,
        kernel=kernel_name,
        linears=swapped,
        windows=len(windows),
        tokens=tokens,
        kl=float(metrics.kl),
        top1=float(metrics.top1),
        max_abs_diff=worst,
        seconds=round(time.time() - started, 2),
    )
