"""Pre-quantized Hugging Face releases: the two layouts frontier models ship their weights in, as data, and
pure functions that recognise them from config.json, check them from the SafeTensors headers and one tensor
at a time, and dequantize them one tensor at a time.

**FP8 block** (`quant_method: "fp8"`; DeepSeek-V3/R1, Qwen3's "-FP8" releases). config.json:
`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`.
Each quantized Linear stores `<module>.weight` as float8_e4m3fn [out, in] and `<module>.weight_scale_inv`
[ceil(out / 128), ceil(in / 128)], one scale per 128 x 128 block; the weight is `fp8 * weight_scale_inv`
per block, computed in float32. A block that overhangs the matrix (out or in not a multiple of 128: DeepSeek's
`kv_a_proj_with_mqa`, 576 rows) was zero-padded to 128 before its scale was taken, and the padding dropped.
Embeddings, norms, routers and the head stay in bf16. The scales are float32 in DeepSeek's release and
bfloat16 in Qwen3's dense ones (HabanaAI/vllm-fork pull 2141, checked on Qwen3-32B-FP8; modular/modular issue
7142 reads 196 BF16 scales in Qwen3-1.7B-FP8's header), so any float dtype is read. `scale_fmt: "ue8m0"` (DeepSeek's
later releases) keeps float scales that are powers of two.
Sources: deepseek-ai/DeepSeek-V3 `README_WEIGHTS.md` ("FP8 Weight Documentation": the config, the padding,
"(128x128 weight block) * weight_scale_inv"), `inference/kernel.py` (`weight_dequant_kernel`: `x.to(float32)
* s` per block, masked at the edges; `weight_quant_kernel`: s = amax / 448), `inference/model.py` (`Linear`:
scale [ceil(out/128), ceil(in/128)] float32 for an 8-bit weight only), `inference/fp8_cast_bf16.py` (the
scale of `X` is `X + "_scale_inv"`); transformers 5.17 `utils/quantization_config.py` (`FineGrainedFP8Config`:
weight_block_size defaults to (128, 128), activation_scheme to "dynamic", `modules_to_not_convert`,
`scale_fmt`), `integrations/finegrained_fp8.py` (`FP8Linear`: the same scale shape; `Fp8Dequantize`).

**MXFP4** (`quant_method: "mxfp4"`; gpt-oss). config.json: `{"quant_method": "mxfp4",
"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
"lm_head"]}`: only the experts are quantized. Each expert projection `P` (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) is stored as `P_blocks` uint8 [E, rows, cols / 32, 16] (32 FP4 E2M1 values in 16
bytes, value 2k in byte k's low nibble and 2k + 1 in its high nibble) and `P_scales` uint8 [E, rows, cols / 32]
(the OCP MX E8M0 shared exponent: 2^(byte - 127); 0xFF is NaN). Decoded it is [E, rows, cols], the
projection's `out x in` matrix; transformers' gpt-oss holds its transpose, `gate_up_proj` [E, hidden, 2I]
and `down_proj` [E, I, hidden], which is the released tensor here. Sources: openai/gpt-oss
`gpt_oss/torch/weights.py` (`FP4_VALUES`, `_get_mxfp4_tensor`: low nibble first, `ldexp(value, scale -
127)`); transformers 5.17 `integrations/mxfp4.py` (`FP4_VALUES`, `convert_moe_packed_tensors`: the same decode,
then `transpose(1, 2)`; `Mxfp4GptOssExperts`: the stored shapes); the config as released in
huggingface.co/openai/gpt-oss-120b config.json; the OCP Microscaling Formats (MX) v1.0 specification (E8M0,
E2M1).

What transformers 5.17 itself does with an FP8 block matrix that is not a multiple of the block is not the
release's arithmetic: its `Fp8Dequantize` takes the block as rows // scale_rows, so 200 rows under 2 row scales
are cut into blocks of 100 (and 129 rows are refused). kiln follows DeepSeek's kernel; on whole blocks the two
agree bit for bit (tests/formats/test_prequantized.py).

compressed-tensors writes block FP8 (`quant_method: "compressed-tensors"`) and MXFP4 in its own spelling
(`weight_scale`, `weight_packed`, its config groups); a source in that spelling is refused here with that
reason. Everything about a quantized source that is wrong is one `QuantizedSourceInvalid`
(SOURCE_QUANTIZATION_INVALID) naming the file, the tensor or the config field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError, SourceInvalid
from kiln.core.untrusted import short_repr
from kiln.formats.safetensors import TensorInfo

if TYPE_CHECKING:
    import torch


class QuantizedSourceInvalid(SourceInvalid):
    """A pre-quantized source whose quantization is not its declared layout (config, scales, shapes, values)."""

    code = Codes.SOURCE_QUANTIZATION_INVALID


class StoredQuantized(KilnError):
    """A stage read a pre-quantized weight as if it were plain: it must dequantize it (and record that it did)
    or carry its stored tensors through as they are."""

    code = Codes.SOURCE_STORED_QUANTIZED


# -- the layouts, as data ------------------------------------------------------------------------------------

E4M3_MAX: Final = 448.0  # the largest float8_e4m3fn; DeepSeek's scale is a block's amax / 448
# float8_e4m3fn has no infinity; S.1111.111 is its NaN (OCP OFP8 v1.0), whatever the sign.
E4M3_NAN_BITS: Final = 0x7F
# The 16 E2M1 values by nibble (openai/gpt-oss `FP4_VALUES`; transformers `integrations/mxfp4.FP4_VALUES`).
FP4_VALUES: Final = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK: Final = 32  # values sharing one E8M0 scale
MX_BLOCK_BYTES: Final = 16  # two E2M1 values a byte
E8M0_BIAS: Final = 127
E8M0_NAN: Final = 0xFF


Shape = tuple[int, ...]
# One of a layout's shape rules: a shape and the block (FP8: rows x columns of one scale; MXFP4: values per scale).
ShapeRule = Callable[[Shape, Shape], Shape]


@dataclass(frozen=True)
class StoredPart:
    """One of the two tensors a quantized released tensor is stored as: its name, SafeTensors dtype and shape."""

    name: str
    dtype: str
    shape: Shape


@dataclass(frozen=True)
class QuantLayout:
    """One released layout, as data: how its quantized tensors are named, typed and shaped in the SafeTensors files.

    A quantized tensor is stored as two: its values (`<prefix><values_suffix>`) and their scales
    (`<prefix><scale_suffix>`); the released tensor, dequantized, is `<prefix><released_suffix>`. Their shapes
    follow from one another by the layout's rules, each of a shape and the block: the values' from the released
    tensor's (`values_shape`) and back (`released_shape`), the scales' from the values' (`scale_shape`).
    `plan_quantized` checks a release's headers by these rules, and `ModelShape.stored_tensors` names and sizes a
    release from config.json alone by them (`SourceQuantization.stored`)."""

    name: str  # kiln's name for it
    quant_method: str  # config.json's quantization_config.quant_method
    values_suffix: str
    scale_suffix: str
    released_suffix: str
    values_dtypes: tuple[str, ...]  # SafeTensors dtypes of the values; the first is the one written
    # SafeTensors dtypes of the scales; the first is its reference release's, which sizing from config.json assumes
    scale_dtypes: tuple[str, ...]
    values_ndim: int
    values_note: str  # how the values hold the released tensor's numbers, for messages
    released_ndim: int
    values_shape: ShapeRule
    released_shape: ShapeRule
    scale_shape: ShapeRule

    def released_name(self, values_name: str) -> str:
        return values_name.removesuffix(self.values_suffix) + self.released_suffix

    def values_name(self, released_name: str) -> str:
        return released_name.removesuffix(self.released_suffix) + self.values_suffix

    def scale_name(self, values_name: str) -> str:
        return values_name.removesuffix(self.values_suffix) + self.scale_suffix

    def module(self, released_name: str) -> str:
        """The module a released tensor belongs to, as `modules_to_not_convert` names it: `model.layers.0.self_attn.
        q_proj` for its `.weight`, `model.layers.0.mlp.experts` for `...experts.down_proj`."""
        return released_name.rsplit(".", 1)[0]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _same_shape(shape: Shape, block: Shape) -> Shape:
    return shape  # FP8's values are the released matrix (named functions, not lambdas: a layout pickles)


def _fp8_scales(values: Shape, block: Shape) -> Shape:
    """[ceil(rows / block rows), ceil(columns / block columns)]: one scale per block, the last ones overhanging."""
    (rows, cols), (br, bc) = values, block
    return (_ceil_div(rows, br), _ceil_div(cols, bc))


def _mxfp4_values(released: Shape, block: Shape) -> Shape:
    """[E, in, out] as released (transformers' orientation) -> [E, out, in / 32, 16]: each row of the projection's
    `out x in` matrix in blocks of 32 values, two a byte (an `in` that is no whole number of blocks is cut short,
    and `released_shape` then does not give `released` back)."""
    experts, cols, rows = released
    return (experts, rows, cols // block[0], block[0] // 2)


def _mxfp4_released(values: Shape, block: Shape) -> Shape:
    experts, rows, groups, _ = values
    return (experts, groups * block[0], rows)


def _mxfp4_scales(values: Shape, block: Shape) -> Shape:
    return values[:-1]  # one E8M0 byte per block of values


FP8_BLOCK: Final = QuantLayout(
    name="fp8-block",
    quant_method="fp8",
    values_suffix=".weight",
    scale_suffix=".weight_scale_inv",
    released_suffix=".weight",
    values_dtypes=("F8_E4M3",),
    scale_dtypes=("F32", "BF16", "F16"),
    values_ndim=2,
    values_note="one float8_e4m3fn a value",
    released_ndim=2,
    values_shape=_same_shape,
    released_shape=_same_shape,
    scale_shape=_fp8_scales,
)
MXFP4: Final = QuantLayout(
    name="mxfp4",
    quant_method="mxfp4",
    values_suffix="_blocks",
    scale_suffix="_scales",
    released_suffix="",
    values_dtypes=("U8",),
    scale_dtypes=("U8",),
    values_ndim=4,
    values_note=f"{MX_BLOCK} values in {MX_BLOCK_BYTES} bytes a block",
    released_ndim=3,
    values_shape=_mxfp4_values,
    released_shape=_mxfp4_released,
    scale_shape=_mxfp4_scales,
)
LAYOUTS: Final[dict[str, QuantLayout]] = {layout.quant_method: layout for layout in (FP8_BLOCK, MXFP4)}
# Other 8-bit floats an FP8 release might hold: not e4m3fn, which `fmt: e4m3` (float8_e4m3fn) declares.
_OTHER_FP8: Final = ("F8_E5M2", "F8_E4M3FNUZ")
# Other spellings of a pre-quantized release, refused with the reason.
_REFUSED_METHODS: Final = {
    "compressed-tensors": "a compressed-tensors source (its own spelling: config groups, `weight_scale`, "
    "`weight_packed`) is not read as a source yet",
}
FP8_DEFAULT_BLOCK: Final = (128, 128)  # FineGrainedFP8Config's, where config.json gives no weight_block_size
MAX_BLOCK: Final = 4096  # one side of an FP8 block: released ones are 128
MAX_PATTERNS: Final = 256  # modules_to_not_convert: released lists name a handful
_PATTERN: Final = re.compile(r"^[A-Za-z0-9_.*\-]{1,256}$")


# -- config.json ---------------------------------------------------------------------------------------------


class _Fp8BlockConfig(BaseModel):
    """`FineGrainedFP8Config`'s keys as a release writes them; absent ones read as transformers reads them."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    activation_scheme: Literal["dynamic"] = "dynamic"
    weight_block_size: list[int] = Field(default=list(FP8_DEFAULT_BLOCK), min_length=2, max_length=2)
    modules_to_not_convert: list[str] | None = Field(default=None, max_length=MAX_PATTERNS)
    scale_fmt: Literal["float", "ue8m0"] = "float"


class _Mxfp4Config(BaseModel):
    """`Mxfp4Config`'s keys as gpt-oss writes them."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    quant_method: Literal["mxfp4"]
    modules_to_not_convert: list[str] | None = Field(default=None, max_length=MAX_PATTERNS)


@dataclass(frozen=True)
class SourceQuantization:
    """What config.json's `quantization_config` declares, checked: the layout, its block (FP8: rows x columns
    of one scale; MXFP4: the 32 values of one scale), how its scales are kept, and the modules it leaves
    unquantized, as written."""

    layout: QuantLayout
    block: tuple[int, ...]
    scale_fmt: str
    not_converted: tuple[str, ...] = ()

    def keeps_unquantized(self, module: str) -> bool:
        """Whether `modules_to_not_convert` names `module`, as transformers matches it
        (`quantizers_utils.should_convert_module`: the pattern matching at the start of the name, or the name
        ending with it), `*` standing for any characters and every other character for itself."""
        return any(_matches(pattern, module) for pattern in self.not_converted)

    def stored(self, name: str, shape: Shape) -> tuple[StoredPart, StoredPart]:
        """How the layout stores released tensor `name` of `shape`: its values and its scales, named, typed (the
        layout's first dtypes: DeepSeek-V3's float32 FP8 scales) and shaped by the layout's rules, which
        `plan_quantized` checks a release's headers by. A shape the layout cannot store (MXFP4 inputs that are
        no whole number of 32-value blocks) is refused."""
        layout = self.layout
        values_shape = layout.values_shape(shape, self.block) if len(shape) == layout.released_ndim else ()
        if not values_shape or layout.released_shape(values_shape, self.block) != shape:
            raise QuantizedSourceInvalid(
                f"config.json: quantization_config: {layout.name} cannot store {name!r} {list(shape)} in blocks "
                f"of {' x '.join(map(str, self.block))}",
                details={"file": "config.json", "field": "quantization_config", "tensor": name},
            )
        values = StoredPart(layout.values_name(name), layout.values_dtypes[0], values_shape)
        scale = StoredPart(
            layout.scale_name(values.name), layout.scale_dtypes[0], layout.scale_shape(values_shape, self.block)
        )
        return values, scale


def _matches(pattern: str, module: str) -> bool:
    """`pattern` matches a prefix of `module` (its `*` any characters), or `module` ends with it; in one pass
    over `module` per piece, whatever the pattern (no regular expression is built from config.json)."""
    first, *rest = pattern.split("*")
    at = len(first) if module.startswith(first) else -1
    for piece in rest:
        if at < 0:
            break
        found = module.find(piece, at)
        at = found + len(piece) if found >= 0 else -1
    return at >= 0 or module.endswith(pattern)


def _is_layout(method: object) -> bool:
    return isinstance(method, str) and method in LAYOUTS


def declares_prequantized(config: Mapping[str, Any]) -> bool:
    """Whether config.json declares one of the release layouts here (`read_quantization` checks it); a
    compressed-tensors bundle, kiln's own artifacts' layout, does not."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and _is_layout(qc.get("quant_method"))


def read_quantization(config: Mapping[str, Any]) -> SourceQuantization | None:
    """A source's quantization as config.json declares it (None: not quantized), or an error naming the field: a
    `quant_method` that is no release layout here (compressed-tensors, GPTQ) is refused."""
    return read_quantization_config(config.get("quantization_config"))


def read_quantization_config(qc: object, *, other_methods: bool = False) -> SourceQuantization | None:
    """config.json's `quantization_config` (`qc`), the one reader of it: None where absent; a release layout's,
    checked (`SOURCE_QUANTIZATION_INVALID` naming the field); another method's refused, or None with
    `other_methods` (the architecture schema reads kiln's own compressed-tensors bundles too, whose tensors this
    module does not plan)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _config_invalid("quantization_config", f"must be an object, got {short_repr(qc)}")
    method = qc.get("quant_method")
    if not _is_layout(method) and other_methods:
        return None
    if isinstance(method, str) and method in _REFUSED_METHODS:
        raise _config_invalid("quantization_config.quant_method", f"{method!r}: {_REFUSED_METHODS[method]}")
    if not _is_layout(method):
        raise _config_invalid(
            "quantization_config.quant_method",
            f"{short_repr(method)} is not a layout kiln reads; it reads {', '.join(map(repr, LAYOUTS))} "
            "(FP8 block releases, gpt-oss MXFP4)",
        )
    schema = _Fp8BlockConfig if method == "fp8" else _Mxfp4Config
    try:
        parsed = schema.model_validate(qc)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in ("quantization_config", *err["loc"]))
        msg = "is not a key of this layout" if err["type"] == "extra_forbidden" else err["msg"]
        raise _config_invalid(loc, f"{msg}, got {short_repr(err.get('input'))}") from None
    patterns = tuple(parsed.modules_to_not_convert or ())
    bad = next((p for p in patterns if not _PATTERN.match(p)), None)
    if bad is not None:
        raise _config_invalid(
            "quantization_config.modules_to_not_convert",
            f"{short_repr(bad)} is not a module name (letters, digits, _ . - and * only)",
        )
    if isinstance(parsed, _Fp8BlockConfig):
        block = tuple(parsed.weight_block_size)
        if not all(0 < b <= MAX_BLOCK for b in block):
            raise _config_invalid(
                "quantization_config.weight_block_size", f"each side must be 1..{MAX_BLOCK}, got {list(block)}"
            )
        return SourceQuantization(FP8_BLOCK, block, parsed.scale_fmt, patterns)
    return SourceQuantization(MXFP4, (MX_BLOCK,), "e8m0", patterns)


def _config_invalid(field: str, message: str) -> QuantizedSourceInvalid:
    return QuantizedSourceInvalid(f"config.json: {field}: {message}", details={"file": "config.json", "field": field})


# -- the headers ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedTensor:
    """One released tensor stored quantized: its name and shape as released (dequantized), and its two
    stored tensors."""

    name: str
    shape: tuple[int, ...]
    values: TensorInfo
    scale: TensorInfo

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def parts(self) -> tuple[TensorInfo, TensorInfo]:
        return (self.values, self.scale)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes


class QuantizationRecord(BaseModel):
    """A source's quantization as ingest checked it: part of the source's identity (the ingest record)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layout: str = Field(description="fp8-block or mxfp4 (formats.prequantized.LAYOUTS)")
    quant_method: str = Field(description="config.json's quantization_config.quant_method")
    block_size: list[int] = Field(description="FP8: rows and columns per scale; MXFP4: values per scale")
    scale_dtype: str = Field(description="the SafeTensors dtype of the scales")
    scale_fmt: str = Field(description="float, ue8m0 (power-of-two float scales) or e8m0 (MXFP4 exponents)")
    tensors: int = Field(description="released tensors stored quantized")
    parameters: int = Field(description="their elements, dequantized")
    stored_bytes: int = Field(description="their values and scales, as stored")
    modules_to_not_convert: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class QuantizedPlan:
    """Every quantized tensor of a source, planned from its headers, by released name."""

    quantization: SourceQuantization
    tensors: dict[str, QuantizedTensor]

    @property
    def stored_names(self) -> set[str]:
        return {p.name for qt in self.tensors.values() for p in qt.parts}

    def released(self, stored: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
        """The source's tensors by released name: the unquantized as stored; each quantized one in place of its
        two stored tensors, with its released name and shape and its values' dtype, file and bytes."""
        out: dict[str, TensorInfo] = {}
        parts = self.stored_names
        by_values = {qt.values.name: qt for qt in self.tensors.values()}
        for name, info in stored.items():
            qt = by_values.get(name)
            if qt is not None:
                out[qt.name] = TensorInfo(qt.name, info.dtype, qt.shape, info.file, info.offset, info.nbytes)
            elif name not in parts:
                out[name] = info
        return out

    def record(self) -> QuantizationRecord:
        q = self.quantization
        scale_dtypes = sorted({qt.scale.dtype for qt in self.tensors.values()})
        return QuantizationRecord(
            layout=q.layout.name,
            quant_method=q.layout.quant_method,
            block_size=list(q.block),
            scale_dtype=",".join(scale_dtypes),
            scale_fmt=q.scale_fmt,
            tensors=len(self.tensors),
            parameters=sum(qt.numel for qt in self.tensors.values()),
            stored_bytes=sum(qt.nbytes for qt in self.tensors.values()),
            modules_to_not_convert=list(q.not_converted),
        )


def check_undeclared(tensors: Mapping[str, TensorInfo]) -> None:
    """A source that declares no quantization holds none: a tensor stored as a layout's values or scales is
    refused naming it and the layout, rather than as a count or dtype that config.json does not explain."""
    for name, t in tensors.items():
        for layout in LAYOUTS.values():
            scale = name.endswith(layout.scale_suffix)
            if scale or (t.dtype in layout.values_dtypes and name.endswith(layout.values_suffix)):
                raise _tensor_invalid(
                    t,
                    f"is stored as {layout.name} {'scales' if scale else 'values'}, but config.json declares no "
                    f"quantization_config (a {layout.name} release declares quant_method {layout.quant_method!r})",
                )


def plan_quantized(quantization: SourceQuantization, tensors: Mapping[str, TensorInfo]) -> QuantizedPlan:
    """Pair every quantized tensor of the headers with its scales and check both against the layout: the values'
    dtype and rank, a scale tensor for each with the exact shape and dtype the block implies, no scale without
    its values, nothing quantized in a module `modules_to_not_convert` keeps, and at least one tensor quantized.
    Reads no tensor data."""
    layout = quantization.layout
    planned: dict[str, QuantizedTensor] = {}
    for name, t in tensors.items():
        if name.endswith(layout.scale_suffix) or not _is_values(layout, t):
            continue
        scale_name = layout.scale_name(name)
        scale = tensors.get(scale_name)
        if scale is None:
            raise _tensor_invalid(t, f"is stored {layout.name} but its scales {scale_name!r} are missing")
        if scale.dtype not in layout.scale_dtypes:
            raise _tensor_invalid(
                scale, f"has dtype {scale.dtype}; {layout.name} scales are {' or '.join(layout.scale_dtypes)}"
            )
        shape = _released_shape(quantization, t, scale)
        module = layout.module(layout.released_name(name))
        if quantization.keeps_unquantized(module):
            raise _tensor_invalid(
                t,
                f"is stored {layout.name}, but quantization_config.modules_to_not_convert keeps {module!r} unquantized",
            )
        released = layout.released_name(name)
        planned[released] = QuantizedTensor(released, shape, t, scale)
    paired = {qt.scale.name for qt in planned.values()}
    orphans = sorted(n for n in tensors if n.endswith(layout.scale_suffix) and n not in paired)
    if orphans:
        values = layout.values_suffix.join(orphans[0].rsplit(layout.scale_suffix, 1))
        what = f"{values!r} is {tensors[values].dtype}" if values in tensors else f"there is no {values!r}"
        raise QuantizedSourceInvalid(
            f"{tensors[orphans[0]].file}: {len(orphans)} scale tensor(s) scale nothing, e.g. {orphans[0]!r} "
            f"({what}, not {layout.name} values)",
            details={"file": tensors[orphans[0]].file, "tensor": orphans[0], "orphans": orphans[:20]},
        )
    if not planned:
        raise QuantizedSourceInvalid(
            f"config.json declares {layout.quant_method} ({layout.name}) but no tensor is stored that way",
            details={"file": "config.json", "field": "quantization_config.quant_method"},
        )
    return QuantizedPlan(quantization, planned)


def _is_values(layout: QuantLayout, t: TensorInfo) -> bool:
    """Whether `t` is a layout's quantized values (its dtype, and for MXFP4 its name); an 8-bit float of another
    kind in an FP8 release is refused."""
    if layout is FP8_BLOCK and t.dtype in _OTHER_FP8:
        raise _tensor_invalid(t, f"is {t.dtype}; fmt e4m3 declares float8_e4m3fn (F8_E4M3)")
    if t.dtype not in layout.values_dtypes:
        return False
    if layout is MXFP4 and not t.name.endswith(layout.values_suffix):
        return False
    if layout is FP8_BLOCK and not t.name.endswith(layout.values_suffix):
        raise _tensor_invalid(t, "is F8_E4M3 but not a Linear's weight (only `.weight` tensors are quantized)")
    if len(t.shape) != layout.values_ndim:
        raise _tensor_invalid(
            t, f"has shape {list(t.shape)}; {layout.name} values have {layout.values_ndim} dimensions"
        )
    return True


def _released_shape(q: SourceQuantization, t: TensorInfo, scale: TensorInfo) -> Shape:
    """The released shape of values `t`, once `t` and its scales are what the layout's rules make of it: the
    values as the layout stores a tensor of that shape (only MXFP4's can differ, in its bytes a block), one scale
    per block."""
    layout, block = q.layout, q.block
    released = layout.released_shape(t.shape, block)
    want = layout.values_shape(released, block)
    if t.shape != want:
        raise _tensor_invalid(
            t,
            f"has shape {list(t.shape)}; {layout.name} holds {layout.values_note}, so its last dimension must be "
            f"{want[-1]}",
        )
    want = layout.scale_shape(t.shape, block)
    if scale.shape != want:
        if layout is FP8_BLOCK:
            blocks = f"{block[0]} x {block[1]} blocks (quantization_config.weight_block_size)"
            rule = f"weight {list(t.shape)} in {blocks} needs"
        else:
            rule = f"blocks {list(t.shape)} need one scale each:"
        raise _tensor_invalid(scale, f"has shape {list(scale.shape)}; {rule} {list(want)}")
    return released


def _tensor_invalid(t: TensorInfo, message: str) -> QuantizedSourceInvalid:
    return QuantizedSourceInvalid(f"{t.file}: tensor {t.name!r} {message}", details={"file": t.file, "tensor": t.name})


# -- one tensor at a time ------------------------------------------------------------------------------------


def check_scale(quantization: SourceQuantization, qt: QuantizedTensor, scale: torch.Tensor) -> None:
    """A quantized tensor's scales, as read: FP8's finite and > 0 (powers of two under `ue8m0`), MXFP4's
    E8M0 exponents not 0xFF (NaN)."""
    import torch

    _check_read(qt.scale, scale)
    if quantization.layout is MXFP4:
        bad = scale == E8M0_NAN
        if bool(bad.any()):
            raise _value_invalid(qt.scale, bad, scale, "is 0xFF, E8M0's NaN")
        return
    s = scale.to(torch.float32)
    bad = ~torch.isfinite(s) | (s <= 0)
    if bool(bad.any()):
        raise _value_invalid(qt.scale, bad, s, "is not a finite scale > 0")
    if quantization.scale_fmt == "ue8m0":
        bad = torch.frexp(s).mantissa != 0.5
        if bool(bad.any()):
            raise _value_invalid(qt.scale, bad, s, "is not a power of two (scale_fmt ue8m0)")


def check_values(quantization: SourceQuantization, qt: QuantizedTensor, values: torch.Tensor) -> None:
    """A quantized tensor's values, as read: no FP8 NaN (every E2M1 nibble is a number)."""
    import torch

    _check_read(qt.values, values)
    if quantization.layout is FP8_BLOCK:
        bad = (values.view(torch.uint8) & E4M3_NAN_BITS) == E4M3_NAN_BITS
        if bool(bad.any()):
            raise _value_invalid(qt.values, bad, values.float(), "is NaN")


def _check_read(info: TensorInfo, t: torch.Tensor) -> None:
    from kiln.formats.safetensors import DTYPES

    if tuple(t.shape) != info.shape or str(t.dtype).removeprefix("torch.") != DTYPES[info.dtype].torch:
        raise QuantizedSourceInvalid(
            f"{info.file}: tensor {info.name!r} read as {t.dtype} {list(t.shape)}, planned {info.dtype} "
            f"{list(info.shape)}",
            details={"file": info.file, "tensor": info.name},
        )


def _value_invalid(info: TensorInfo, bad: torch.Tensor, values: torch.Tensor, what: str) -> QuantizedSourceInvalid:
    import torch

    count = int(bad.sum())
    index = [int(i) for i in torch.nonzero(bad)[0]]
    value = values[tuple(index)].item()
    return QuantizedSourceInvalid(
        f"{info.file}: tensor {info.name!r}: {count} value(s) invalid, e.g. at {index}: {value!r} {what}",
        details={"file": info.file, "tensor": info.name, "index": index, "count": count},
    )


def dequantize(
    quantization: SourceQuantization,
    qt: QuantizedTensor,
    values: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The released tensor `qt` from its stored values and scales, both checked first, in `dtype` (float32 when
    None). FP8: each element `float32(fp8) * float32(scale)` of its block, as DeepSeek's `weight_dequant`;
    MXFP4: each E2M1 value times 2^(exponent - 127) (exact in float32 and bfloat16), transposed to the released
    orientation. Never mutates its inputs."""
    import torch

    check_scale(quantization, qt, scale)
    check_values(quantization, qt, values)
    if quantization.layout is FP8_BLOCK:
        out = _dequantize_fp8(values, scale, quantization.block)
    else:
        out = _decode_mxfp4(values, scale)
    if not bool(torch.isfinite(out).all()):  # an MXFP4 scale of 2^127 on a value of 2 or more
        raise _value_invalid(qt.values, ~torch.isfinite(out), out, "dequantizes to a non-finite number")
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)


def _dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    import torch

    rows, cols = values.shape
    br, bc = block
    out = values.to(torch.float32)
    s = scale.to(torch.float32)
    # One block row at a time: its scales repeated over their columns, cut where the last block overhangs.
    for i in range(s.shape[0]):
        out[i * br : (i + 1) * br].mul_(s[i].repeat_interleave(bc)[:cols])
    return out


def _decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    import torch

    experts, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty((experts, rows, groups, MX_BLOCK), dtype=torch.float32)
    for e in range(experts):  # one expert at a time: the nibble indices are 16 bytes for each stored byte
        b = blocks[e]
        out[e, ..., 0::2] = lut[(b & 0x0F).long()]
        out[e, ..., 1::2] = lut[(b >> 4).long()]
        torch.ldexp(out[e], scales[e].to(torch.int32)[..., None] - E8M0_BIAS, out=out[e])
    return out.reshape(experts, rows, groups * MX_BLOCK).transpose(1, 2).contiguous()


def dequantize_stream(
    plan: QuantizedPlan, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs as stored -> as released: each quantized tensor's two stored tensors become the
    released tensor, dequantized (`dequantize`), under its released name; every other tensor passes unchanged
    (not cast: its dtype is the caller's to change). A stored part waits for its partner, so memory holds at
    most the parts whose partner has not come yet: one tensor for a stream in plan order (each values tensor
    next to its scales). A part left without its partner at the end is an error."""
    q = plan.quantization
    owner = {p.name: qt for qt in plan.tensors.values() for p in qt.parts}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        qt = owner.get(name)
        if qt is None:
            yield name, t
            continue
        got = pending.setdefault(qt.name, {})
        got[name] = t
        if len(got) == 2:
            del pending[qt.name]
            yield qt.name, dequantize(q, qt, got[qt.values.name], got[qt.scale.name], dtype)
    if pending:
        name, got = next(iter(pending.items()))
        qt = plan.tensors[name]
        missing = next(p for p in qt.parts if p.name not in got)
        raise QuantizedSourceInvalid(
            f"{missing.file}: tensor {missing.name!r} never came, so {name!r} cannot be dequantized",
            details={"file": missing.file, "tensor": missing.name},
        )
