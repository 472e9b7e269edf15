"""The catalog of quantization methods: one table (`METHODS`), gathered from one module per family.

Every quant-keyed table elsewhere is derived from it (`SCHEMES`, the gates of `eval.gates`, the matmul
dtype resolve sizes with, the FP8 handling of the ROCm bundle and of round-to-nearest) or checked against it
by a test that fails when a method is missing from a target's table (tests/quant/test_catalog.py). Adding a
method is its family module (or a new one listed in `FAMILIES`), and its rows in the targets that build it.

`compatibility(scheme)` answers, for every hardware profile of `core.hardware`, whether a bundle of the
method runs there and why: the same for every method on a CPU (transformers + compressed-tensors decompress
the weights on x86_64; other CPUs are served GGUF), on TPUs and on NVIDIA GPUs older than sm80 (vLLM's
floor); otherwise the method's own `on_cuda` / `on_rocm`.

`source_route(method, quantization)` says what a method does with a pre-quantized source's quantized tensors
(`Method.from_sources`: keep the release's bytes, dequantize first, or refuse with the reason); `kiln plan`
refuses a recipe asking for a refused one (QUANT_SOURCE_REFUSED), and a release-only method (`mxfp4-experts`, a
release's own layout) for a plain source (QUANT_RELEASE_ONLY): `check_source`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, UnknownName
from kiln.core.hardware import PROFILES, HardwareProfile
from kiln.quant.methods import dense, fp4, fp8, int4, int8
from kiln.quant.methods.base import Method, SourceRoute
from kiln.quant.schemes import HEAD_CHOICES, HeadChoice, Scheme, Verdict

if TYPE_CHECKING:
    from kiln.formats.prequantized import SourceQuantization

FAMILIES: Final = (dense, fp8, int8, int4, fp4)
METHODS: Final[dict[str, Method]] = {m.name: m for family in FAMILIES for m in family.METHODS}
SCHEMES: Final[dict[str, Scheme]] = {name: m.scheme for name, m in METHODS.items()}


def get_method(name: str) -> Method:
    """The method called `name`; an unknown name is an error listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise UnknownName(
            f"unknown quantization scheme {name!r}; known: {', '.join(METHODS)}",
            details={"scheme": name, "known": list(METHODS)},
        ) from None


class HeadNotQuantizable(InvalidInput):
    """`lm_head: quantized` for a scheme that quantizes nothing (bf16)."""

    code = Codes.QUANT_HEAD_UNSUPPORTED


def get_scheme(name: str, lm_head: HeadChoice = "kept") -> Scheme:
    """The scheme of the method called `name`, its `lm_head` kept in bf16 (the preset) or quantized; an unknown
    name is an error listing the known ones."""
    scheme = get_method(name).scheme
    if lm_head not in HEAD_CHOICES:
        raise InvalidInput(f"lm_head must be one of {', '.join(HEAD_CHOICES)}; got {lm_head!r}")
    if lm_head == "quantized" and not scheme.quantized:
        raise HeadNotQuantizable(
            f"scheme {name!r} quantizes nothing, so it cannot quantize lm_head", details={"scheme": name}
        )
    if lm_head == "quantized" and METHODS[name].release_only:
        raise HeadNotQuantizable(
            f"scheme {name!r} keeps a release's own tensors, lm_head in bf16 as released; it cannot quantize it",
            details={"scheme": name},
        )
    return scheme.with_lm_head(lm_head)


def _verdict(method: Method, hw: HardwareProfile) -> Verdict:
    if hw.family == "cpu":
        if hw.arch != "x86_64":
            return Verdict(
                compatible=False,
                reason=f"{hw.name} ({hw.arch}) is served GGUF by llama.cpp; bundles are tested on x86_64",
            )
        if method.release_only:
            return Verdict(compatible=True, reason="transformers dequantizes the release's quantized tensors at load")
        if method.scheme.quantized:
            return Verdict(compatible=True, reason="transformers + compressed-tensors decompress the weights on CPU")
        return Verdict(compatible=True, reason="transformers on CPU")
    if hw.family == "cuda":
        if (hw.compute_capability or 0) < 80:
            return Verdict(compatible=False, reason=f"vLLM needs sm80+; {hw.name} is {hw.arch}")
        return method.on_cuda(method, hw)
    if hw.family == "rocm":
        return method.on_rocm(method, hw)
    return Verdict(compatible=False, reason=f"{hw.family} does not run vLLM or transformers bundles")


def compatibility(scheme: Scheme, profiles: dict[str, HardwareProfile] | None = None) -> dict[str, Verdict]:
    """For every hardware profile: whether a bundle of `scheme` runs on it, and why (or why not)."""
    method = get_method(scheme.name)
    return {name: _verdict(method, hw) for name, hw in (profiles or PROFILES).items()}


def compatible_hardware(scheme: Scheme) -> dict[str, str]:
    """Hardware a bundle of `scheme` runs on, with the reason for each."""
    return {name: v.reason for name, v in compatibility(scheme).items() if v.compatible}


class QuantSourceRefused(InvalidInput):
    """A method the catalog does not build from a source released in this quantized layout (`Method.from_sources`)."""

    code = Codes.QUANT_SOURCE_REFUSED


class QuantReleaseOnly(InvalidInput):
    """A release-only method (a release's own layout, `Method.release_only`) asked of a plain source."""

    code = Codes.QUANT_RELEASE_ONLY


def _block(method: Method) -> tuple[int, ...] | None:
    """The values one scale covers in the method's weights, as a release states it: FP8 blocks as rows x columns,
    groups (MXFP4) as their length."""
    w = method.scheme.weights
    if w is None:
        return None
    return w.block_structure if w.block_structure is not None else (w.group_size,) if w.group_size else None


def check_source(method: Method, quantization: SourceQuantization | None) -> SourceRoute | None:
    """What `kiln plan` checks of a method and the source's quantization: a pre-quantized source's route
    (`source_route`); for a plain source (None) nothing, unless the method is a release's own layout, which kiln
    only keeps: refused (QUANT_RELEASE_ONLY) with the reason."""
    if quantization is not None:
        return source_route(method, quantization)
    if method.release_only:
        kept = sorted(layout for layout, route in method.from_sources.items() if route.action == "keep")
        reason = (
            f"{method.name} is a release's own layout, written only by keeping the bytes of a source released "
            f"{' or '.join(kept)}; this source is plain (unquantized), and kiln quantizes no stacked experts"
        )
        raise QuantReleaseOnly(reason, details={"quant": method.name, "layouts": kept, "reason": reason})
    return None


def source_route(method: Method, quantization: SourceQuantization) -> SourceRoute:
    """What `method` does with the quantized tensors of a source released as `quantization`: its route for the
    layout (`Method.from_sources`), refused here with the reason where it refuses. Keeping the release's bytes also
    needs its blocks to be the method's (a 64 x 64 FP8 release is not 128 x 128 fp8-block)."""
    layout = quantization.layout.name
    route = method.from_sources.get(layout)
    if route is None:  # every method declares every layout (tests/quant/test_catalog.py)
        raise QuantSourceRefused(
            f"{method.name} declares nothing for a {layout} source", details={"quant": method.name}
        )
    mine_block = _block(method)
    if route.action == "keep" and mine_block != quantization.block:
        block = "x".join(map(str, quantization.block))
        mine = "x".join(map(str, mine_block)) if mine_block else "none"
        route = SourceRoute(
            "refuse",
            f"the release's blocks are {block} and {method.name}'s {mine}: its bytes cannot be kept, and quantizing "
            "them into other blocks rounds them a second time",
        )
    if route.action == "refuse":
        raise QuantSourceRefused(
            f"{method.name} from a source released {layout}: {route.reason}",
            details={"quant": method.name, "layout": layout, "reason": route.reason},
        )
    return route
