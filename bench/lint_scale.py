"""`kiln lint` at scale: time and peak memory on artifacts of Llama-3-70B's and Llama-3-8B's shapes.

The artifacts are sparse files: every header and every scale is written (scales 1.0, `weight_shape` the
weight's shape, a Q8_0 tensor's first block scale), the weights themselves are holes (zeros), so a 70B
artifact takes the disk its scales take. The lint reads headers, then every scale (an HF bundle's scale
tensors, each memory-mapped alone; every block of a GGUF tensor, 16 MiB at a time), never a weight; each
artifact is linted by `kiln lint --json` in a fresh process, beside the same command on a tiny artifact
(the process's own baseline: Python, numpy, the CLI), and must pass.

    python bench/lint_scale.py [--work DIR] [--cases fp8-70b,int4-rtn-70b,q8_0-8b]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import add_record_argument, run_record, save_record  # noqa: E402

LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
SHAPES = {
    "70b": {**LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80},
    "8b": {
        **LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
}
SHARD_BYTES = 5_000_000_000


def _tensors(config: dict[str, Any], quant: str) -> list[tuple[str, str, tuple[int, ...], bytes | None]]:
    """(name, dtype, shape, contents or None for zeros) of the bundle, in checkpoint order."""
    from kiln.formats.architectures.shape import ModelShape
    from kiln.quant.catalog import get_scheme
    from kiln.quant.rtn import planned_tensors, quantizes

    scheme = get_scheme(quant)
    out: list[tuple[str, str, tuple[int, ...], bytes | None]] = []
    for spec in ModelShape.from_config(config).tensors():
        if not quantizes(scheme, spec.name):
            out.append((spec.name, "BF16", spec.shape, None))
            continue
        for name, dtype, shape in planned_tensors(scheme, spec.name, spec.shape):
            contents = None
            if name.endswith("weight_scale"):
                contents = struct.pack("<H", 0x3F80) * math.prod(shape)  # bf16 1.0
            elif name.endswith("weight_shape"):
                contents = struct.pack("<2q", *spec.shape)
            out.append((name, dtype, shape, contents))
    return out


def write_bundle(out: Path, size: str, quant: str) -> int:
    """A sparse hf-bundle of `quant` at `size`; returns its apparent bytes."""
    from kiln.formats.safetensors import DTYPES
    from kiln.quant.catalog import get_scheme
    from kiln.quant.compressed import quantization_config

    config = dict(SHAPES[size], quantization_config=quantization_config(get_scheme(quant)))
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    tensors = _tensors(SHAPES[size], quant)
    shards: list[list[tuple[str, str, tuple[int, ...], bytes | None]]] = [[]]
    used = 0
    for t in tensors:
        nbytes = math.prod(t[2]) * DTYPES[t[1]].itemsize
        if shards[-1] and used + nbytes > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += nbytes
    weight_map, total = {}, 0
    for i, members in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape, _ in members:
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        start = 8 + len(raw)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(start + offset)
            for name, _, _, contents in members:
                if contents is not None:
                    f.seek(start + header[name]["data_offsets"][0])
                    f.write(contents)
        total += start + offset
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def write_gguf(out: Path, size: str) -> int:
    """A sparse Q8_0 GGUF of `size` (2-D tensors Q8_0, norms F32): header, then each tensor's first block scale."""
    from kiln.formats.architectures import FAMILIES
    from kiln.formats.architectures.shape import ModelShape
    from kiln.formats.gguf.constants import GGUF_ALIGNMENT, GGUF_MAGIC, TYPE_TRAITS, Keys, TensorType, ValueType
    from kiln.targets.lint.gguf import gguf_tensor_name

    shape = ModelShape.from_config(SHAPES[size])
    kvs: list[tuple[str, ValueType, Any]] = [
        (Keys.ARCHITECTURE, ValueType.STRING, "llama"),
        (Keys.QUANTIZATION_VERSION, ValueType.UINT32, 2),
        (Keys.FILE_TYPE, ValueType.UINT32, 7),
    ]
    for key, value in (
        (Keys.CONTEXT_LENGTH, shape.max_position_embeddings),
        (Keys.EMBEDDING_LENGTH, shape.hidden_size),
        (Keys.BLOCK_COUNT, shape.num_layers),
        (Keys.FEED_FORWARD_LENGTH, shape.intermediate_size),
        (Keys.HEAD_COUNT, shape.num_heads),
        (Keys.HEAD_COUNT_KV, shape.num_kv_heads),
        (Keys.ROPE_DIMENSION_COUNT, shape.head_dim),
    ):
        kvs.append((key.format(arch="llama"), ValueType.UINT32, value))
    kvs.append((Keys.ROPE_FREQ_BASE.format(arch="llama"), ValueType.FLOAT32, shape.rope_theta))
    kvs.append((Keys.LAYERNORM_RMS_EPS.format(arch="llama"), ValueType.FLOAT32, shape.rms_norm_eps))

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    infos, firsts, offset = b"", [], 0
    for spec in shape.tensors():
        ttype = TensorType.Q8_0 if len(spec.shape) == 2 else TensorType.F32
        traits = TYPE_TRAITS[ttype]
        name = gguf_tensor_name(spec, FAMILIES["llama"])
        dims = tuple(reversed(spec.shape))
        infos += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, int(ttype), offset)
        if ttype is TensorType.Q8_0:
            firsts.append(offset)
        offset += (
            (math.prod(spec.shape) // traits.block_size * traits.type_size + GGUF_ALIGNMENT - 1)
            // GGUF_ALIGNMENT
            * GGUF_ALIGNMENT
        )
    head = struct.pack("<IIQQ", GGUF_MAGIC, 3, len(shape.tensors()), len(kvs))
    for key, vtype, value in kvs:
        head += string(key) + struct.pack("<I", vtype)
        head += (
            string(value)
            if vtype is ValueType.STRING
            else struct.pack("<f" if vtype is ValueType.FLOAT32 else "<I", value)
        )
    head += infos
    head += b"\0" * (-len(head) % GGUF_ALIGNMENT)
    out.mkdir(parents=True)
    with open(out / f"model-{size}-q8_0.gguf", "wb") as f:
        f.write(head)
        f.truncate(len(head) + offset)
        for at in firsts:
            f.seek(len(head) + at)
            f.write(struct.pack("<e", 1.0))
    return len(head) + offset


def lint(path: Path) -> dict[str, Any]:
    """`kiln lint --json` of `path` in a fresh process: its wall time, peak RSS and answer."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec.
    code = (
        "import re, sys, time; from kiln.cli import main; sys.argv = ['kiln', 'lint', '--json', sys.argv[1]]\n"
        "t = time.time()\ntry:\n main()\nexcept SystemExit as e:\n"
        " hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
        " print(f'@@ {e.code} {time.time() - t:.3f} {hwm}', file=sys.stderr)"
    )
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - start
    tail = [ln for ln in proc.stderr.splitlines() if ln.startswith("@@ ")]
    if not tail:
        raise RuntimeError(f"kiln lint {path} failed:\n{proc.stderr[-2000:]}")
    rc, seconds, rss_kib = tail[-1].split()[1:]
    doc = json.loads(proc.stdout)
    return {
        "rc": int(rc),
        "lint_s": float(seconds),
        "process_s": round(wall, 2),
        "peak_rss_mib": round(int(rss_kib) / 1024, 1),
        "tensors": sum(a["tensors"] for a in doc["artifacts"]),
        "scales": sum(a["scales"] for a in doc["artifacts"]),
        "scale_bytes": sum(a["scale_bytes"] for a in doc["artifacts"]),
        "errors": doc["errors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-lint-bench"))
    parser.add_argument("--cases", default="fp8-70b,int4-rtn-70b,q8_0-8b")
    add_record_argument(parser, "lint_scale")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    rows = []
    tiny = args.work / "tiny"
    from tests.model_factory import make_bundle, make_model  # the baseline: a tiny real model's fp8 bundle

    src = make_model(args.work / "tiny-src")
    rows.append({"case": "tiny fp8 (baseline)", "apparent_gb": 0.0, **lint(make_bundle(src, tiny, "fp8"))})
    for case in args.cases.split(","):
        quant, size = case.rsplit("-", 1)
        path = args.work / case
        made = time.time()
        apparent = write_gguf(path, size) if quant == "q8_0" else write_bundle(path, size, quant)
        on_disk = sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())
        print(f"{case}: written in {time.time() - made:.1f}s ({apparent / 1e9:.1f} GB, {on_disk / 1e6:.0f} MB on disk)")
        rows.append({"case": case, "apparent_gb": round(apparent / 1e9, 1), **lint(path)})
        shutil.rmtree(path)
    print(
        f"\n{'case':<22}{'GB':>7}{'tensors':>9}{'scales':>8}{'scale MB':>10}{'lint s':>8}{'peak RSS MiB':>14}  errors"
    )
    for r in rows:
        print(
            f"{r['case']:<22}{r['apparent_gb']:>7}{r['tensors']:>9}{r['scales']:>8}{r['scale_bytes'] / 1e6:>10.1f}"
            f"{r['lint_s']:>8.2f}{r['peak_rss_mib']:>14.1f}  {r['errors']}"
        )
    save_record(run_record(rows=rows), args.record)


if __name__ == "__main__":
    main()
