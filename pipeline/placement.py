"""Where a compute stage computes: the build's device, placed on the nodes that can use one.

The compute stages are the reference, calibrated quantization (GPTQ, AWQ) and the evals whose runtime
kiln runs on the stage's device (`eval.runtimes.facts.RUNTIME_FACTS[...].on_stage_device`: transformers,
the JAX forward, vLLM). The planner puts the device's kind in such a node's params and the device itself
in its args; every other stage (ingest, round-to-nearest, exports, llama.cpp's eval) computes where it
always did.

The kind (`cpu` / `cuda`) is part of the cache key: a reference or a calibration computed on a GPU
differs from the CPU's in the last bits (other kernels, other reduction orders), so it is another stage
output, and a store never mixes the two under one key. Which GPU (`cuda:1`, an H100 or an H200) is
not: the planner cannot know which GPU a Ray node will grant, and a key must be computable when the
graph is planned (`kiln plan`, a CI job's `kiln run-stage`). The GPU a stage ran on, its name and memory,
are recorded in its provenance (`core.device.describe`), so outputs of different GPUs are told apart
by what they say, not by their keys.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kiln.core.device import CPU, Device, parse_device, resolve_device
from kiln.pipeline.requirements import Requirements
from kiln.pipeline.stage import Node

DEVICE_PARAM = "device"  # in a compute node's params: its device kind (in the key); in its args: the device


def device_params(device: Device) -> dict[str, Any]:
    """What a compute node's params say of its device: its kind."""
    return {DEVICE_PARAM: device.kind}


def device_args(device: Device) -> dict[str, Any]:
    """What a compute node's args say of its device: the device as given (`cuda:1`), not in the key."""
    return {DEVICE_PARAM: str(device)}


def placed(node: Node, requires: Requirements) -> Requirements:
    """`requires` with at least the one GPU a node placed on one needs (Ray's `num_gpus`); the stages'
    own requirements already count theirs (`pipeline.requirements`), and may ask for more."""
    if node.params.get(DEVICE_PARAM) == "cuda" and requires.gpus == 0:
        return requires.model_copy(update={"gpus": 1})
    return requires


def computes_on_device(node: Node) -> bool:
    return DEVICE_PARAM in node.params


def node_device(node: Node) -> Device:
    """The device `node` was placed on (the CPU for a node that is not a compute node)."""
    if not computes_on_device(node):
        return CPU
    spec = node.args.get(DEVICE_PARAM, node.params[DEVICE_PARAM])
    device = parse_device(str(spec))
    kind = node.params[DEVICE_PARAM]
    if device is None or device.kind != kind:  # args that disagree with the key: a graph built wrong
        raise ValueError(f"{node.id}: placed on {spec!r}, but its key says {kind!r}")
    return device


def stage_device(node: Node) -> Device:
    """The device a running compute node computes on, checked against what this process sees (under Ray:
    the GPU it was granted); DEVICE_UNAVAILABLE when it is not there."""
    return resolve_device(node_device(node))


def with_device(node: Node, device: Device) -> Node:
    """`node` placed on `device` (a copy; the kind goes in its params, so in its key). The stage's params record
    (`pipeline.records`) holds the kind: a stage that cannot be placed refuses it."""
    params = {**node.params, **device_params(device)}
    if node.stage.params is not None:
        node.stage.params.model_validate(params)
    return replace(node, params=params, args={**node.args, **device_args(device)})
