"""The device a compute stage runs on: parsed once from `--device`, checked against this machine, described.

`--device auto|cpu|cuda|cuda:N` (the local executor, `kiln build`, `kiln run-stage`): `auto` is the
first CUDA device when one is visible, else the CPU. Under the Ray executor the placement decides: a
stage placed on a GPU asks Ray for `num_gpus=1`, Ray sets `CUDA_VISIBLE_DEVICES` to the GPU it
granted, and the stage runs on `cuda` (the first, and only, visible device).

A `Device` is frozen data; a malformed string is `INVALID_DEVICE`, a CUDA device this machine does
not have is `DEVICE_UNAVAILABLE` (both bad input: the CLI exits 2). `describe` is what a stage's
provenance records: the device, its name and its memory (the CPU's model name and RAM for the CPU).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput

DeviceKind = Literal["cpu", "cuda"]
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
_SPEC = re.compile(r"(?P<kind>cpu)|(?P<cuda>cuda)(?::(?P<index>[0-9]{1,3}))?")


class InvalidDevice(InvalidInput):
    """A device string that is not auto, cpu, cuda or cuda:N."""

    code = Codes.INVALID_DEVICE


class DeviceUnavailable(InvalidInput):
    """A device this machine (or this Ray worker) does not have."""

    code = Codes.DEVICE_UNAVAILABLE


@dataclass(frozen=True)
class Device:
    """A compute device: the CPU, or a CUDA device (`index` None: the first visible one, e.g. the GPU Ray granted)."""

    kind: DeviceKind = "cpu"
    index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise InvalidDevice(f"device kind {self.kind!r}; known: cpu, cuda")
        if self.index is not None and (self.kind == "cpu" or self.index < 0):
            raise InvalidDevice(f"device index {self.index} on {self.kind}")

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def torch(self) -> str:
        """The torch device string: `cpu`, or `cuda:N` (the first visible device when no index was given)."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index or 0}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


CPU = Device()


def parse_device(spec: str) -> Device | None:
    """`cpu` / `cuda` / `cuda:N` as a Device, `auto` as None (decided by `resolve_device`); else INVALID_DEVICE."""
    text = spec.strip().lower()
    if text == "auto":
        return None
    match = _SPEC.fullmatch(text)
    if match is None:
        raise InvalidDevice(
            f"--device {spec!r}: expected one of {', '.join(DEVICE_CHOICES)} (N a CUDA device number)",
            details={"device": str(spec), "known": list(DEVICE_CHOICES)},
        )
    if match.group("kind"):
        return CPU
    index = match.group("index")
    return Device("cuda", int(index) if index is not None else None)


def cuda_device_count() -> int:
    """How many CUDA devices this process sees (0 without torch or without a GPU)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def resolve_device(spec: str | Device | None, *, visible: int | None = None) -> Device:
    """The device `spec` names on this machine (`visible`: how many CUDA devices it has; None asks torch).

    `auto` (or None) is `cuda` when a CUDA device is visible, else the CPU. `cuda` / `cuda:N` that this
    machine does not have is DEVICE_UNAVAILABLE, never a silent fall back to the CPU.
    """
    device = parse_device(spec) if isinstance(spec, str) else spec
    if device is not None and device.kind == "cpu":
        return device
    count = cuda_device_count() if visible is None else visible
    if device is None:
        return Device("cuda") if count > 0 else CPU
    if count == 0:
        raise DeviceUnavailable(
            f"--device {device}: no CUDA device is visible here (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu or auto",
            details={"device": str(device), "visible": 0},
        )
    if (device.index or 0) >= count:
        raise DeviceUnavailable(
            f"--device {device}: this machine has {count} CUDA device(s) (0..{count - 1})",
            details={"device": str(device), "visible": count},
        )
    return device


def visible_gpus(device: Device, *, visible: int | None = None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries a child process computing on `device` gets: `cuda` every GPU this
    process sees (under Ray, those the stage was granted), `cuda:N` the N-th of them; [] for the CPU."""
    if not device.is_cuda:
        return []
    count = cuda_device_count() if visible is None else visible
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in listed.split(",") if d.strip()][:count] if listed else [str(i) for i in range(count)]
    if device.index is None:
        return ids
    if device.index >= len(ids):
        raise DeviceUnavailable(
            f"--device {device}: this machine has {len(ids)} CUDA device(s)", details={"device": str(device)}
        )
    return [ids[device.index]]


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (from /proc/cpuinfo), or the platform's processor string."""
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def _ram_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def host_memory_bytes() -> int | None:
    """The memory this process's stages may use: the machine's RAM, or its cgroup's limit where lower (a
    container), or `KILN_HOST_MEMORY` (bytes) where set lower still (a machine shared with other work)."""
    limits = [_ram_bytes()]
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        limits.append(int(text) if text.isdigit() else None)
    except OSError:
        pass
    configured = os.environ.get("KILN_HOST_MEMORY")
    if configured:
        if not configured.isdigit():
            raise InvalidInput(
                f"KILN_HOST_MEMORY must be a number of bytes, got {configured[:40]!r}", code=Codes.INVALID_HOST_MEMORY
            )
        limits.append(int(configured))
    known = [m for m in limits if m]
    return min(known) if known else None


def describe(device: Device) -> dict[str, Any]:
    """What a stage's provenance records of its device: the device, its name and memory (and, for CUDA, the
    compute capability, the CUDA runtime torch was built with, and the visible-device mask Ray or the user set)."""
    if device.kind == "cpu":
        return {"device": "cpu", "name": cpu_model(), "memory_bytes": _ram_bytes(), "cores": os.cpu_count()}
    import torch

    index = device.index or 0
    props = torch.cuda.get_device_properties(index)
    return {
        "device": device.torch,
        "name": torch.cuda.get_device_name(index),
        "memory_bytes": int(props.total_memory),
        "capability": f"sm{props.major}{props.minor}",
        "cuda": torch.version.cuda,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
