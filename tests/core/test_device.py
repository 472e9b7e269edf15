"""`--device`: parsed once into a frozen Device, checked against the machine, described for provenance."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.core.device import (
    CPU,
    Device,
    DeviceUnavailable,
    InvalidDevice,
    cpu_model,
    cuda_device_count,
    describe,
    parse_device,
    resolve_device,
    visible_gpus,
)
from kiln.core.errors import InvalidInput


@pytest.mark.parametrize(
    ("spec", "device"),
    [
        ("cpu", CPU),
        ("CPU", CPU),
        ("cuda", Device("cuda")),
        ("cuda:0", Device("cuda", 0)),
        ("cuda:3", Device("cuda", 3)),
    ],
)
def test_device_strings_parse_into_frozen_devices(spec: str, device: Device) -> None:
    parsed = parse_device(spec)
    assert parsed == device
    assert str(parsed) == spec.lower()
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.kind = "cuda"  # type: ignore[misc, union-attr]


@pytest.mark.parametrize("spec", ["cuda:x", "gpu", "cuda:", "cuda:-1", "cpu:0", "", "cuda:0:1", "tpu"])
def test_a_malformed_device_is_invalid_input_naming_the_choices(spec: str) -> None:
    with pytest.raises(InvalidDevice) as e:
        parse_device(spec)
    assert e.value.code == "INVALID_DEVICE" and isinstance(e.value, InvalidInput)
    assert "auto, cpu, cuda, cuda:N" in e.value.message


def test_auto_is_a_gpu_when_one_is_visible_else_the_cpu() -> None:
    assert parse_device("auto") is None
    assert resolve_device("auto", visible=0) == CPU
    assert resolve_device("auto", visible=2) == Device("cuda")
    assert resolve_device("cuda:1", visible=2) == Device("cuda", 1)
    assert resolve_device("cpu", visible=0) == CPU


def test_a_cuda_device_the_machine_lacks_is_unavailable_never_the_cpu() -> None:
    with pytest.raises(DeviceUnavailable) as e:
        resolve_device("cuda", visible=0)
    assert e.value.code == "DEVICE_UNAVAILABLE" and "--device cpu" in e.value.message
    with pytest.raises(DeviceUnavailable) as e:
        resolve_device("cuda:2", visible=2)
    assert e.value.details == {"device": "cuda:2", "visible": 2}


@pytest.mark.skipif(cuda_device_count() > 0, reason="this machine has a CUDA device")
def test_on_this_machine_without_a_gpu_cuda_is_unavailable_and_auto_is_the_cpu() -> None:
    assert resolve_device("auto") == CPU
    with pytest.raises(DeviceUnavailable):
        resolve_device("cuda")


def test_the_cpu_is_described_by_its_model_name_and_memory() -> None:
    d = describe(CPU)
    assert d["device"] == "cpu" and d["name"] == cpu_model() and d["name"] not in ("", "unknown")
    assert d["memory_bytes"] > 2**30
    assert cpu_model("processor\t: 0\nmodel name\t: Test CPU @ 1GHz\n") == "Test CPU @ 1GHz"


def test_torch_device_strings() -> None:
    assert CPU.torch == "cpu" and Device("cuda").torch == "cuda:0" and Device("cuda", 2).torch == "cuda:2"
    with pytest.raises(InvalidDevice):
        Device("cpu", 1)


@pytest.mark.parametrize(
    ("listed", "device", "gpus"),
    [
        (None, Device("cuda"), ["0", "1", "2", "3"]),
        (None, Device("cuda", 2), ["2"]),
        ("5,7", Device("cuda"), ["5", "7"]),  # Ray granted two GPUs: both, by their ids
        ("5,7", Device("cuda", 1), ["7"]),
        ("GPU-1a2b, GPU-3c4d", Device("cuda"), ["GPU-1a2b", "GPU-3c4d"]),
        ("5,7", CPU, []),
    ],
)
def test_a_child_computing_on_a_device_sees_the_gpus_it_was_granted(
    monkeypatch: pytest.MonkeyPatch, listed: str | None, device: Device, gpus: list[str]
) -> None:
    if listed is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    visible = 4 if listed is None else len(listed.split(","))
    assert visible_gpus(device, visible=visible) == gpus


def test_a_gpu_index_past_those_granted_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with pytest.raises(DeviceUnavailable):
        visible_gpus(Device("cuda", 2), visible=2)
