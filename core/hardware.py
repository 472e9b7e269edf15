"""The hardware catalog: every fact about a device that kiln reasons with, as validated data.

The built-in catalog is `core/hardware.yaml`; a registry extends or overrides it through its API
(`registry/hardware`) without a code change. Targets decide compatibility from an entry's family,
arch, compute capability and FP8 flavour, never from its name, so a new SKU of a known architecture
is served the artifacts its architecture runs. Resolve sizes replicas and bounds speed and cost from
its memory, bandwidth, FLOP/s, interconnect and price, each peak scaled by the share of it a measurement
reached on that SKU (`measured`: `kiln hardware probe`) where the entry has one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import date
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticUndefined

from kiln.core.datafile import parse_record, read_data_file
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, UnknownName

CATALOG_FILE = Path(__file__).with_name("hardware.yaml")

Family = Literal["cuda", "rocm", "tpu", "cpu", "metal"]
Fp8Flavour = Literal["e4m3fn", "e4m3fnuz"]
# The 4-bit float block formats a device's matmuls take natively: NVIDIA's NVFP4 (16 E2M1 values under an E4M3
# scale, and a float32 tensor scale) and the OCP MX format's MXFP4 (32 E2M1 values under an E8M0 scale).
Fp4Format = Literal["nvfp4", "mxfp4"]
MatmulDtype = Literal["bf16", "fp8", "int8", "fp4"]
HARDWARE_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,31}$"
_WORD = r"^[A-Za-z0-9][A-Za-z0-9._ -]{0,63}$"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# The range of each number an entry gives: physical bounds, wide enough for any real device (a 10-GB/s
# edge board, a CPU node of terabytes, a rack-scale accelerator) and narrow enough that resolve's
# arithmetic (bytes ÷ bandwidth, FLOPs ÷ FLOP/s, price ÷ tokens/s) stays finite and meaningful.
# Numbers are strict: a JSON number (an integer is a number), never a string or a boolean.
MEMORY_GIB = (1, 16_384)  # 1 GiB to 16 TiB per device
BANDWIDTH_GBS = (1, 100_000)  # 1 GB/s to 100 TB/s, memory and interconnect
TFLOPS = (0.01, 100_000)  # 10 GFLOP/s to 100 PFLOP/s dense, per device
TP_EFFICIENCY = (0.05, 1)  # (0.05, 1]: above 0.05, so a TP group's bound is never near zero
PRICE_PER_DEVICE_HOUR = (0, 10_000)  # USD
COMPUTE_CAPABILITY = (10, 1000)
DEVICES_PER_NODE = (1, 1024)
# A measured share of a data-sheet peak: a small-M matmul reaches a few percent of the FLOP/s, a type a device has
# no fast kernel for far less (INT8 on a CPU without VNNI: a few GOP/s, under 0.001 of the `cpu` socket's 4 TOP/s),
# and a generic entry's peak (the `cpu` socket) may sit below what a larger machine measures, hence up to 2.
FRACTION = (0.0001, 2)


def _number(
    bounds: tuple[float, float],
    description: str | None = None,
    *,
    above: bool = False,
    default: Any = PydanticUndefined,
) -> Any:
    """A strict, finite number from `bounds[0]` (or, `above`, past it) to `bounds[1]`; required without `default`."""
    low, high = bounds
    if above:
        return Field(default, strict=True, gt=low, le=high, allow_inf_nan=False, description=description)
    return Field(default, strict=True, ge=low, le=high, allow_inf_nan=False, description=description)


class Tflops(_Frozen):
    """Dense peak TFLOP/s per device by matmul input type (int8 in TOP/s); absent: no such units."""

    bf16: float = _number(TFLOPS)
    fp8: float | None = _number(TFLOPS, default=None)
    int8: float | None = _number(TFLOPS, default=None)
    fp4: float | None = _number(TFLOPS, default=None)


class DtypeFractions(_Frozen):
    """Measured shares of a peak by the type of the matmul's inputs; absent: not measured."""

    bf16: float | None = _number(FRACTION, default=None)
    fp8: float | None = _number(FRACTION, default=None)
    int8: float | None = _number(FRACTION, default=None)
    fp4: float | None = _number(FRACTION, default=None)

    def given(self) -> dict[str, float]:
        """The measured types and their shares."""
        return {
            k: v
            for k, v in (("bf16", self.bf16), ("fp8", self.fp8), ("int8", self.int8), ("fp4", self.fp4))
            if v is not None
        }


class MeasuredEfficiency(_Frozen):
    """The shares of an SKU's data-sheet peaks measured on one of its devices, and where and how.

    Resolve multiplies each peak by its share where one is given (`placement.fit`); `kiln hardware
    probe` measures them (kiln/probe.py) and, with `--publish`, records them in a registry's catalog."""

    memory_read: float = _number(
        FRACTION, "share of bandwidth_gbs a read of a buffer far larger than any cache reaches"
    )
    decode: DtypeFractions = Field(
        default_factory=DtypeFractions,
        description="share of bandwidth_gbs a decode-like chain reaches (one token: M=1 matmuls over weights read "
        "through the matmul of that type: bf16 weights, FP8 through scaled matmuls, ...)",
    )
    matmul: DtypeFractions = Field(
        default_factory=DtypeFractions, description="share of tflops.<type> a large-M matmul (prefill-like) reaches"
    )
    matmul_small_m: DtypeFractions = Field(
        default_factory=DtypeFractions, description="share of tflops.<type> a small-M matmul reaches (recorded only)"
    )
    allocatable_gib: float | None = _number(
        MEMORY_GIB, "GiB one process can allocate on a device (what the runtime leaves)", default=None
    )
    source: str = Field(
        min_length=1, max_length=300, description="where and how: the device or product, runtime versions, method"
    )
    measured_on: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$", description="the date measured, YYYY-MM-DD")

    @model_validator(mode="after")
    def _readable(self) -> MeasuredEfficiency:
        if not self.source.isprintable():
            raise ValueError("source is printable text")
        try:
            date.fromisoformat(self.measured_on)
        except ValueError:
            raise ValueError(f"measured_on {self.measured_on!r} is not a date (YYYY-MM-DD)") from None
        return self


class Interconnect(_Frozen):
    """What joins a node's devices into one tensor-parallel group."""

    name: str = Field(pattern=_WORD)
    bandwidth_gbs: float = _number(BANDWIDTH_GBS)
    tp_efficiency: float = _number(TP_EFFICIENCY, "share of summed bandwidth/FLOP/s kept under TP", above=True)


class HardwareProfile(_Frozen):
    """One SKU: what it is, what it computes in, and what it costs."""

    name: str = Field(pattern=HARDWARE_NAME_PATTERN)
    vendor: str = Field(pattern=r"^[a-z0-9-]{1,32}$")
    family: Family
    arch: str = Field(pattern=r"^[a-z0-9_.-]{1,32}$", description="sm90, gfx942, tpu-v5e, x86_64, ...")
    compute_capability: int | None = Field(
        default=None,
        strict=True,
        ge=COMPUTE_CAPABILITY[0],
        le=COMPUTE_CAPABILITY[1],
        description="NVIDIA only, e.g. 90",
    )
    fp8: Fp8Flavour | None = Field(default=None, description="the FP8 type its matmuls take; None: no FP8 units")
    fp4: tuple[Fp4Format, ...] = Field(
        default=(), max_length=2, description="the FP4 block formats its matmuls take; empty: no FP4 units"
    )
    memory_gib: float = _number(MEMORY_GIB)
    bandwidth_gbs: float = _number(BANDWIDTH_GBS)
    tflops: Tflops
    interconnect: Interconnect | None = None
    devices_per_node: int = Field(default=1, strict=True, ge=DEVICES_PER_NODE[0], le=DEVICES_PER_NODE[1])
    price_per_device_hour: float | None = _number(PRICE_PER_DEVICE_HOUR, "USD per device-hour", default=None)
    products: tuple[str, ...] = Field(default=(), max_length=16)
    measured: MeasuredEfficiency | None = Field(
        default=None, description="measured shares of its peaks (kiln hardware probe); absent: resolve uses the peaks"
    )

    @model_validator(mode="after")
    def _consistent(self) -> HardwareProfile:
        if (self.family == "cuda") != (self.compute_capability is not None):
            raise ValueError("compute_capability is given for NVIDIA (family cuda) devices, and only for them")
        if self.devices_per_node > 1 and self.interconnect is None:
            raise ValueError("a node of several devices needs its interconnect (for tensor parallelism)")
        if self.fp8 is not None and self.tflops.fp8 is None:
            raise ValueError("a device with FP8 units needs tflops.fp8")
        if bool(self.fp4) != (self.tflops.fp4 is not None):
            raise ValueError("tflops.fp4 is given exactly for a device with FP4 units (fp4: its formats)")
        if len(set(self.fp4)) != len(self.fp4):
            raise ValueError("fp4 lists each format once")
        if any(not (0 < len(p) <= 64) or not p.isprintable() for p in self.products):
            raise ValueError("products are printable names of 1 to 64 characters")
        if self.measured is not None:
            m = self.measured
            for kind, fractions in (("decode", m.decode), ("matmul", m.matmul), ("matmul_small_m", m.matmul_small_m)):
                for dtype in fractions.given():
                    if getattr(self.tflops, dtype) is None:
                        raise ValueError(f"measured.{kind}.{dtype} is given for a device without {dtype} matmuls")
        return self

    def matmul_tflops(self, dtype: MatmulDtype) -> tuple[float, MatmulDtype]:
        """Peak TFLOP/s for matmuls with `dtype` inputs, and the type they run in (bf16 where it has no such units)."""
        value = getattr(self.tflops, dtype)
        if value is None:
            return self.tflops.bf16, "bf16"
        return float(value), dtype

    @property
    def architecture(self) -> tuple[object, ...]:
        """What decides which artifacts a device runs: targets read these fields, never the SKU's name."""
        return (self.vendor, self.family, self.arch, self.compute_capability, self.fp8, self.fp4)

    @property
    def device_name(self) -> str:
        """The name the vendor's tool reports for it (what an engine build checks it runs on)."""
        return self.products[0] if self.products else self.name


HardwareSource = Literal["builtin", "registry", "registry (overrides builtin)"]


class HardwareOut(HardwareProfile):
    """A catalog entry as the registry answers it, with where it comes from."""

    source: HardwareSource = Field(description="kiln's built-in catalog, or an entry admins gave this registry")

    @classmethod
    def of(cls, profile: HardwareProfile, source: HardwareSource) -> HardwareOut:
        return cls(**profile.model_dump(), source=source)


class HardwareCatalog:
    """SKU name -> profile, with the error that lists the known names."""

    def __init__(self, profiles: Iterable[HardwareProfile]):
        self.profiles: dict[str, HardwareProfile] = {}
        for p in profiles:
            if p.name in self.profiles:
                raise InvalidInput(f"hardware catalog: {p.name!r} is listed twice", code=Codes.HARDWARE_CATALOG_INVALID)
            self.profiles[p.name] = p

    def get(self, name: str) -> HardwareProfile:
        try:
            return self.profiles[name]
        except KeyError:
            known = sorted(self.profiles)
            raise UnknownName(
                f"unknown hardware {name!r}; known: {', '.join(known)}", details={"hardware": name[:64], "known": known}
            ) from None

    def twin(self, profile: HardwareProfile, among: Iterable[str]) -> str | None:
        """The first SKU of `among` (catalog names) with `profile`'s architecture: it runs what that one runs."""
        for name in among:
            known = self.profiles.get(name)
            if known is not None and known.architecture == profile.architecture:
                return name
        return None

    def extended(self, entries: Iterable[HardwareProfile]) -> HardwareCatalog:
        """This catalog with `entries` added, or replacing the entries of the same name."""
        merged = dict(self.profiles)
        for p in entries:
            merged[p.name] = p
        return HardwareCatalog(merged.values())

    def __iter__(self) -> Any:
        return iter(self.profiles.values())


def parse_profile(data: Mapping[str, Any], where: str = "hardware entry") -> HardwareProfile:
    """A validated profile, or HARDWARE_CATALOG_INVALID naming each bad field."""
    return parse_record(HardwareProfile, data, where, Codes.HARDWARE_CATALOG_INVALID)


def parse_entry(name: str, data: Mapping[str, Any]) -> HardwareProfile:
    """The catalog entry for SKU `name` as a file or a request gives it (`kiln hardware set`, `PUT /v1/hardware`):
    its name left out or `name`, and its `source` (as a listing shows one) ignored."""
    if "name" in data and data["name"] != name:
        raise InvalidInput(
            f"hardware entry {name!r}: name: the body names {str(data['name'])[:40]!r}; it must name the SKU of "
            "the path, or leave the name out",
            code=Codes.HARDWARE_CATALOG_INVALID,
        )
    return parse_profile({**{k: v for k, v in data.items() if k != "source"}, "name": name}, f"hardware entry {name!r}")


def load_catalog(path: Path = CATALOG_FILE, what: str = "a hardware catalog") -> HardwareCatalog:
    """Read a catalog file (`schema: 1`, `hardware: [entries]`) with the one data-file reader: a file that is not
    a regular one, not UTF-8 or not YAML or JSON is DATA_FILE_INVALID; a catalog of the wrong shape or with a
    bad entry, HARDWARE_CATALOG_INVALID."""
    data = read_data_file(path, what)
    if not isinstance(data, dict) or data.get("schema") != 1 or not isinstance(data.get("hardware"), list):
        raise InvalidInput(f"{path}: expected `schema: 1` and a `hardware` list", code=Codes.HARDWARE_CATALOG_INVALID)
    return HardwareCatalog(
        parse_profile(entry if isinstance(entry, dict) else {}, f"{path.name} entry {i}")
        for i, entry in enumerate(data["hardware"])
    )


CATALOG_ENV = "KILN_HARDWARE_CATALOG"


@cache
def builtin_catalog() -> HardwareCatalog:
    """The catalog kiln ships (`core/hardware.yaml`), extended by the file `KILN_HARDWARE_CATALOG` names.

    The extension has the same shape; its entries are added, or replace the built-in entry of the
    same name (a site's own SKUs and prices, for builds, without editing the package)."""
    catalog = load_catalog()
    extra = os.environ.get(CATALOG_ENV)
    if extra:
        catalog = catalog.extended(load_catalog(Path(extra), f"the hardware catalog {CATALOG_ENV} names"))
    return catalog


# The catalog's profiles by name: what targets and the pipeline read.
PROFILES: dict[str, HardwareProfile] = builtin_catalog().profiles


def get_profile(name: str) -> HardwareProfile:
    return builtin_catalog().get(name)
