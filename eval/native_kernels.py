"""W8A8 bundles through the matmul kernels a GPU serves them with, against kiln's emulation of them.

kiln evaluates an hf-bundle in transformers, which (with compressed-tensors) dequantizes the FP8 or
int8 weights and fake-quantizes the activations: an emulation of what vLLM computes on a GPU. This
module runs the same bundle through the real low-precision matmuls instead, one per quantized Linear:

| scheme | activations (dynamic) | weights | kernel on CUDA |
|---|---|---|---|
| `fp8` | e4m3fn per token (absmax / 448) | e4m3fn per output channel | `torch._scaled_mm`, row-wise scales |
| `fp8-block` | e4m3fn per token and 128 columns | e4m3fn per 128x128 block | `scaled_mm`, BlockWise1x128 x 128x128 |
| `int8-w8a8` | int8 per token (absmax / 127) | int8 per output channel | `torch._int_mm`, then both scales |

Two models of the bundle run on the same device, built by the same code (`load_native`): one whose
quantized Linears call the kernels, one whose Linears call their float32 emulation (dequantize both
operands' products exactly, accumulate in float32, apply the same scales and the same output rounding).
Every other module (embeddings, norms, attention, `lm_head`) runs in float32 in both, and each kernel's
output is taken in float32 where the kernel can give it (`_int_mm`'s int32 is rescaled in float32), so
the only difference between the two models is the quantized matmuls. `check_kernels` reports, per
scheme, the KL of each against the reference (the source model's logits in float32: the eval's
reference), their relative difference (the headline: how far the kernels move the bundle's measured
quality), and the direct KL, top-1 agreement and largest logit difference between the two.

`kernels="emulated"` builds only the emulated model (it runs on any device: the whole path, reading the
bundle, quantizing activations, the swap of every Linear, the block-scale layout, is exercised on a
CPU); `kernels="native"` needs CUDA (sm89+ for FP8; block FP8 where cuBLAS has it, sm90). A kernel this
torch or GPU lacks raises `KernelUnavailable`, naming every form that was tried.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, KilnError
from kiln.quant.catalog import METHODS

if TYPE_CHECKING:
    import torch

    from kiln.eval.run import Reference

Kernels = Literal["native", "emulated"]
E4M3_MAX = 448.0
INT8_MAX = 127.0
BLOCK = 128
# The catalog's methods whose matmuls take 8-bit inputs (W8A8): fp8, fp8-block, int8-w8a8. (FP4 W4A4 needs
# Blackwell's block-scaled FP4 matmuls, which no GPU this module has run on has: not here; fp8-kv8's FP8 cache
# is attention's, not a matmul's: its Linears are fp8's.)
NATIVE_SCHEMES = tuple(
    name for name, m in METHODS.items() if m.matmul_dtype in ("fp8", "int8") and m.kv_cache_dtype == "bf16"
)


class KernelUnavailable(KilnError):
    """This torch or device has no kernel for the scheme's matmul."""

    code = Codes.KERNEL_UNAVAILABLE


@dataclass(frozen=True)
class KernelCheck:
    """One bundle through one set of kernels and through their emulation, both against the reference."""

    scheme: str
    device: str
    kernels: Kernels
    kernel: str  # the matmul that ran, e.g. "torch._scaled_mm (row-wise)"
    out_dtype: str  # what the kernel's output is taken in (and the emulation rounds to)
    linears: int  # quantized Linears swapped for the kernel
    windows: int
    tokens: int
    kl_native_vs_reference: float  # mean KL(reference || kernels)
    kl_emulated_vs_reference: float  # mean KL(reference || emulation)
    kl_relative_difference: float  # (native - emulated) / emulated: the headline
    kl_native_vs_emulated: float  # mean KL(emulation || kernels): the kernels alone
    top1_native_vs_emulated: float
    top1_native_vs_reference: float
    top1_emulated_vs_reference: float
    max_abs_diff: float  # largest |logit difference| between kernels and emulation
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


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def block_scales(x_scale: torch.Tensor, w_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales of a BlockWise1x128 x BlockWise128x128 FP8 matmul `x [M, K] @ w[N, K]^T` in the layout
    torch's `scaled_mm` (and cuBLAS) take them: the activations' `x_scale [M, K/128]` outer-dim-major
    (stride (1, M)); the weights' `w_scale [N/128, K/128]` (as stored) transposed to `[L4, N/128]` with
    L4 = K/128 rounded up to a multiple of 4 (the padding rows are ones, never read), stride (1, L4)."""
    import torch

    kb = -(-k // BLOCK)
    if x_scale.shape[1] != kb or w_scale.shape[1] != kb:
        raise InvalidInput(f"block scales {tuple(x_scale.shape)}, {tuple(w_scale.shape)} do not cover K={k}")
    l4 = _round_up(kb, 4)
    padded = torch.ones(w_scale.shape[0], l4, dtype=torch.float32, device=w_scale.device)
    padded[:, :kb] = w_scale.float()
    return x_scale.float().t().contiguous().t(), padded.t()


def _blocks_emulated(xq: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """The block-scaled product from the prepared scales (`block_scales`): per 128-column block, the
    e4m3 products summed in float32 (exact products), then that block's two scales."""
    import torch

    rows, cols = w.shape
    w_rows = sb.t().repeat_interleave(BLOCK, 0)[:rows]  # [N, L4]: each output row's block scales
    out = torch.zeros(xq.shape[0], rows, dtype=torch.float32, device=xq.device)
    for b in range(-(-cols // BLOCK)):
        part = slice(b * BLOCK, (b + 1) * BLOCK)
        out += (xq[:, part].float() @ w[:, part].float().t()) * sa[:, b : b + 1] * w_rows[:, b]
    return out


KernelCall = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


class _Kernel:
    """One scheme's matmul, native or emulated: `y[N, O] = quant(x) @ w^T` with both scales, in `out_dtype`."""

    def __init__(
        self,
        scheme: str,
        kernels: Kernels,
        device: torch.device,
        out_dtype: torch.dtype | None = None,
        form: tuple[str, KernelCall] | None = None,  # a native FP8 call form (else found by `_probe`)
    ) -> None:
        import torch

        self.scheme = scheme
        self.kernels = kernels
        self.name = "float32 emulation"
        self.out_dtype = out_dtype if out_dtype is not None else torch.float32
        self._native: KernelCall | None = None
        if kernels == "native":
            if device.type != "cuda":
                raise KernelUnavailable(f"native {scheme} kernels need a CUDA device, not {device}")
            if scheme == "int8-w8a8":
                self.name, self.out_dtype = "torch._int_mm", torch.float32
            elif form is not None:
                self.name, self._native = form
            else:
                self._native, self.name, self.out_dtype = _probe(scheme, device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        import torch

        rows, cols = w.shape
        if self.scheme == "int8-w8a8":
            xq, xs = _quantize_rows(x, 1, INT8_MAX, torch.int8)
            if self.kernels == "native":
                try:
                    acc = torch._int_mm(xq, w.t()).float()
                except RuntimeError:  # a build whose cuBLASLt wants the second operand row-major
                    acc = torch._int_mm(xq, w.t().contiguous()).float()
            else:
                acc = xq.float() @ w.float().t()  # exact: int8 products summed in float32 below 2^24
            return acc * xs * w_scale.reshape(1, -1)
        if self.scheme == "fp8":
            xq, xs = _quantize_rows(x, 1, E4M3_MAX, torch.float8_e4m3fn)
            sa, sb = xs.contiguous(), w_scale.float().reshape(1, -1).contiguous()
            if self._native is not None:
                return self._native(xq, w, sa, sb).float()
            return ((xq.float() @ w.float().t()) * sa * sb).to(self.out_dtype).float()
        # fp8-block: activations per token and 128 columns, weights per 128x128 block
        xq, xs = _quantize_rows(x, -(-cols // BLOCK), E4M3_MAX, torch.float8_e4m3fn)
        sa, sb = block_scales(xs, w_scale, cols)
        if self._native is not None:
            return self._native(xq, w, sa, sb).float()
        return _blocks_emulated(xq, sa, w, sb).to(self.out_dtype).float()


def _native_forms(scheme: str) -> list[tuple[str, KernelCall, torch.dtype]]:
    """The call forms of `scheme`'s FP8 kernel, float32 output first (bf16 where a kernel has only that)."""
    import torch

    forms: list[tuple[str, KernelCall, torch.dtype]] = []
    for out in (torch.float32, torch.bfloat16):
        suffix = f", {str(out).removeprefix('torch.')} out"
        if scheme == "fp8":

            def rowwise(xq: Any, w: Any, sa: Any, sb: Any, out: torch.dtype = out) -> Any:
                return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=out)

            forms.append(("torch._scaled_mm (row-wise" + suffix + ")", rowwise, out))
            continue

        def functional(xq: Any, w: Any, sa: Any, sb: Any, out: torch.dtype = out) -> Any:
            from torch.nn.functional import ScalingType, SwizzleType  # type: ignore[attr-defined]

            return torch.nn.functional.scaled_mm(  # type: ignore[attr-defined]
                xq,
                w.t(),
                sa,
                ScalingType.BlockWise1x128,
                sb,
                ScalingType.BlockWise128x128,
                swizzle_a=SwizzleType.NO_SWIZZLE,
                swizzle_b=SwizzleType.NO_SWIZZLE,
                output_dtype=out,
            )

        def private(xq: Any, w: Any, sa: Any, sb: Any, out: torch.dtype = out) -> Any:
            return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=out)

        forms.append(
            ("torch.nn.functional.scaled_mm (BlockWise1x128 x BlockWise128x128" + suffix + ")", functional, out)
        )
        forms.append(("torch._scaled_mm (block-wise 1x128 x 128x128" + suffix + ")", private, out))
    return forms


def _probe(scheme: str, device: torch.device) -> tuple[KernelCall, str, torch.dtype]:
    """The first FP8 call form this torch and GPU run correctly, checked on a small product (three
    K blocks: a padded block-scale layout) against the emulation in the same output dtype;
    KernelUnavailable naming every form tried when none does."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    n, k, o = 32, 3 * BLOCK, 2 * BLOCK
    x = torch.randn(n, k, generator=g).to(device)
    w = (torch.randn(o, k, generator=g) / 16).to(device)
    tried = []
    for name, call, out in _native_forms(scheme):
        if scheme == "fp8":
            ws = (w.abs().amax(dim=1) / E4M3_MAX).float()
            wq = (w / ws[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        else:
            ws = (w.abs().unflatten(1, (-1, BLOCK)).unflatten(0, (-1, BLOCK)).amax(dim=(1, 3)) / E4M3_MAX).float()
            full = ws.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            wq = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        emulated = _Kernel(scheme, "emulated", device, out)
        want = emulated(x, wq, ws)
        try:
            got = _Kernel(scheme, "native", device, out, form=(name, call))(x, wq, ws)
        except Exception as e:  # an unsupported form: the next one is tried
            tried.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            continue
        err = float((got - want).abs().max() / want.abs().max())
        if err < 2e-2:
            return call, name, out
        tried.append(f"{name}: ran but differs from the emulation by {err:.2e} of the largest value")
    raise KernelUnavailable(
        f"no {scheme} FP8 matmul in this torch runs correctly on this device: " + "; ".join(tried),
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
                self.kernel = kernel

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
    stored = (w.get("type"), w.get("num_bits"), w.get("strategy"), list(w.get("block_structure") or []))
    for name in NATIVE_SCHEMES:
        sw, sa = METHODS[name].scheme.weights, METHODS[name].scheme.input_activations
        assert sw is not None and sa is not None
        if stored == (sw.type, sw.num_bits, sw.strategy, list(sw.block_structure or [])) and a.get("type") == sa.type:
            return name
    raise InvalidInput(
        f"{bundle}: its quantization is none of {', '.join(NATIVE_SCHEMES)}", details={"known": list(NATIVE_SCHEMES)}
    )


def _kernel_of(model: Any) -> _Kernel:
    return next(m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), _Kernel))


def load_native(
    bundle: str | Path, device: str, kernels: Kernels = "native", *, out_dtype: torch.dtype | None = None
) -> tuple[Any, str, str, int]:
    """The bundle as a float32 transformers model on `device` with every quantized Linear running
    `kernels` (the emulation rounding its output to `out_dtype`, float32 by default; a native kernel
    takes the most precise output it has): (model, scheme, kernel name, Linears swapped)."""
    import torch
    import transformers
    from safetensors import safe_open

    bundle = Path(bundle)
    scheme = _bundle_scheme(bundle)
    dev = torch.device(device)
    kernel = _Kernel(scheme, kernels, dev, out_dtype)
    config = transformers.AutoConfig.from_pretrained(str(bundle))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # every weight loaded below
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
    loaded = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
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
    bundle: str | Path,
    windows: Sequence[Sequence[int]],
    device: str,
    reference: Reference,
    kernels: Kernels = "native",
) -> KernelCheck:
    """`bundle` through `kernels` and through their float32 emulation on `device`, every other module in
    float32 in both, each against `reference` (the reference stage's stored rows, or a runtime's float32
    logits) and against each other."""
    import torch

    from kiln.eval.metrics import MetricAccumulator
    from kiln.eval.run import reference_window

    started = time.time()
    model, scheme, kernel_name, swapped = load_native(bundle, device, kernels)
    out_dtype = _kernel_of(model).out_dtype
    # kernels="emulated": the candidate is the emulation itself (its direct KL is 0 by construction).
    emulated = model if kernels == "emulated" else load_native(bundle, device, "emulated", out_dtype=out_dtype)[0]
    vocab = int(model.config.vocab_size)
    native_ref, emulated_ref, direct = MetricAccumulator(vocab), MetricAccumulator(vocab), MetricAccumulator(vocab)
    worst = 0.0
    tokens = 0

    def logits(m: Any, ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out = m(input_ids=torch.tensor([ids], device=m.device), use_cache=False)
        return np.ascontiguousarray(out.logits[0].float().cpu().numpy(), dtype=np.float32)

    for window in windows:
        ids = [int(t) for t in window]
        ref = reference_window(reference, ids, vocab)
        got = logits(model, ids)
        want = got if emulated is model else logits(emulated, ids)
        worst = max(worst, float(np.abs(got - want).max()))
        # Row t predicts token t + 1; the last row predicts past the window and is not scored.
        native_ref.add_rows(ref, got[:-1], ids[1:])
        emulated_ref.add_rows(ref, want[:-1], ids[1:])
        direct.add(want[:-1], got[:-1], ids[1:])
        tokens += len(ids) - 1
    n, e, d = native_ref.result(), emulated_ref.result(), direct.result()
    return KernelCheck(
        scheme=scheme,
        device=str(device),
        kernels=kernels,
        kernel=kernel_name,
        out_dtype=str(out_dtype).removeprefix("torch."),
        linears=swapped,
        windows=len(windows),
        tokens=tokens,
        kl_native_vs_reference=float(n.kl),
        kl_emulated_vs_reference=float(e.kl),
        kl_relative_difference=float((n.kl - e.kl) / e.kl) if e.kl > 0 else float("nan"),
        kl_native_vs_emulated=float(d.kl),
        top1_native_vs_emulated=float(d.top1),
        top1_native_vs_reference=float(n.top1),
        top1_emulated_vs_reference=float(e.top1),
        max_abs_diff=worst,
        seconds=round(time.time() - started, 2),
    )
