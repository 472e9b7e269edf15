"""What the orbax tests share: a model's orbax export (and its int8 values dequantized), the transformers
references they are compared with, and a check run in a fresh process with 8 CPU devices (a mesh)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kiln.eval.runtimes import TransformersRuntime
from kiln.formats.hf_model import open_source
from kiln.quant.catalog import get_scheme
from kiln.quant.store import open_quantized, write_quantized
from kiln.targets.base import ExportRequest, ExportResult, get_target
from kiln.targets.orbax.layout import INT8

ROOT = Path(__file__).resolve().parents[2]


def export_orbax(model_dir: Path, out: Path, quant: str, **params: Any) -> ExportResult:
    """The orbax export of `model_dir` into `out`, with the quantize stage's output beside it for a quantized quant."""
    source = open_source(model_dir)
    quantized = None
    if quant != "bf16":
        qdir = out.parent / f"{out.name}-quantize"
        qdir.mkdir(parents=True)
        write_quantized(source, get_scheme(quant), qdir)
        quantized = open_quantized(qdir, quant)
    out.mkdir(parents=True, exist_ok=True)
    return get_target("orbax").export(
        source, ExportRequest(quant=quant, out_dir=out, params=params, quantized=quantized)
    )


def export(model_dir: Path, out: Path, quant: str = "bf16", **params: Any) -> Path:
    """`export_orbax`'s artifact directory."""
    export_orbax(model_dir, out, quant, **params)
    return out


def exports(models: dict[str, Path], root: Path) -> Callable[[str, str], Path]:
    """`export` of a model by name, once per (name, quant)."""
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, quant: str) -> Path:
        if (name, quant) not in made:
            made[name, quant] = export(models[name], root / f"{name}-{quant}", quant)
        return made[name, quant]

    return get


@contextlib.contextmanager
def references(models: dict[str, Path]) -> Iterator[Callable[[str], TransformersRuntime]]:
    """transformers' runtime of a model by name, opened once, closed at the end."""
    opened: dict[str, TransformersRuntime] = {}

    def get(name: str) -> TransformersRuntime:
        if name not in opened:
            opened[name] = TransformersRuntime(models[name])
        return opened[name]

    try:
        yield get
    finally:
        for rt in opened.values():
            rt.close()


def entropy(logits: np.ndarray) -> float:
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return float(-(np.exp(logp) * logp).sum(-1).mean())


def dequantized_model(model_dir: Path, quant_dir: Path, out: Path) -> Path:
    """The model whose Linear weights are the quantize stage's q * scale, in float32 (exactly what int8 stores)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kiln.quant.rtn import dequantize, quantizes

    quantized = open_quantized(quant_dir, INT8)
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    for name in list(tensors):
        if quantizes(quantized.scheme, name):
            stored = {q: quantized.tensor(q) for q in quantized.module_tensors(name)}
            tensors[name] = dequantize(quantized.scheme, name.removesuffix(".weight"), stored).float().contiguous()
        else:
            tensors[name] = tensors[name].to(torch.float32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def on_an_8_device_mesh(script: str, *args: str) -> Any:
    """Run `script` in a fresh process whose JAX has 8 CPU devices, and answer the JSON its last line prints."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
