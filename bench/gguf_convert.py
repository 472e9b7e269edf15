"""Benchmark: SafeTensors -> GGUF, kiln's `gguf` target against llama.cpp's converter, side by side.

    python bench/gguf_convert.py [--hidden 2048 --intermediate 5632 --layers 22 --vocab 32000] [--repeat 2]

Writes a random Llama-shaped bf16 model (TinyLlama-1.1B shape by default, ~2.2 GB) once under
--work, warms the page cache, then, for F16 and Q8_0, runs in fresh processes (so peak RSS is each
one's own), alternating: llama.cpp's `convert_hf_to_gguf.py` and kiln's export, on the same model.
Throughput is source bytes / wall time; `cp` of the same bytes is the I/O ceiling. The table gives
each one's MB/s and peak RSS and kiln's ratio to the converter, measured in this run.

The peer is the converter of the llama.cpp that llama-cpp-python (the version kiln pins) vendors:
`convert_hf_to_gguf.py`, its `conversion/` package and `gguf-py`, taken from that version's sdist
(downloaded once into --work with pip). It recognises tokenizers by a hash table and refuses the
generated one, so its vocabulary step is skipped (`set_vocab` does nothing): that favours the peer,
whose time then excludes the vocabulary kiln writes. Targets: >= 3x (F16) and >= 2x (Q8_0) at no
more memory. The run's record (command, host, CPU kind, load, results) is printed as JSON and
appended to --record.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
TARGET_X = {"f16": 3.0, "q8_0": 2.0}
# Runs the converter as its own __main__, with the vocabulary step of the model class it picks skipped.
# Every timed child writes its own peak RSS (VmHWM, which starts afresh at exec) to $BENCH_PEAK_RSS_FILE
# when it exits: wait4's ru_maxrss carries the parent's resident size across fork+exec (seen: a
# parent that had just generated the source, or imported torch, gave both children its 2.9 GB).
PEAK_RSS_AT_EXIT = """
import atexit, os
def _write_peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(os.environ["BENCH_PEAK_RSS_FILE"], "w").write(line.split()[1])
atexit.register(_write_peak_rss)
"""
PEER_DRIVER = (
    PEAK_RSS_AT_EXIT
    + """
import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion
found = conversion.get_model_class
def without_vocab(*args, **kwargs):
    cls = found(*args, **kwargs)
    cls.set_vocab = lambda self: None
    return cls
conversion.get_model_class = without_vocab
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
"""
)


def make_source(out: Path, hidden: int, intermediate: int, layers: int, vocab: int, heads: int, kv_heads: int) -> Path:
    """A Llama-shaped random bf16 release: tokenizer and config from the test factory, weights written
    shard by shard (no full model in memory)."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT))
    from tests.model_factory import make_model

    if (out / "model.safetensors.index.json").is_file():
        return out
    make_model(out, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
    for f in out.glob("model*.safetensors"):
        f.unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    kv = kv_heads * (hidden // heads)
    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": w(vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": w(hidden, hidden),
                p + "self_attn.k_proj.weight": w(kv, hidden),
                p + "self_attn.v_proj.weight": w(kv, hidden),
                p + "self_attn.o_proj.weight": w(hidden, hidden),
                p + "mlp.gate_proj.weight": w(intermediate, hidden),
                p + "mlp.up_proj.weight": w(intermediate, hidden),
                p + "mlp.down_proj.weight": w(hidden, intermediate),
            }
        )
    shards.append({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16), "lm_head.weight": w(vocab, hidden)})
    weight_map = {}
    for n, tensors in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def _child(source: str, quant: str, out_dir: str, prepared: str) -> None:
    """Run one export stage's work in this process (the parent times it and reads its peak RSS): open
    the source as the stage does (its digests known) and export, with the target's prepared record."""
    exec(PEAK_RSS_AT_EXIT)
    sys.path.insert(0, str(ROOT))
    from kiln.core.digest import HashCache
    from kiln.formats.hf_model import open_source
    from kiln.targets.base import ExportRequest
    from kiln.targets.gguf.export import export

    src = open_source(source, hasher=HashCache(Path(prepared).with_suffix(".hashes.json")).sha256)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    export(src, ExportRequest(quant=quant, out_dir=Path(out_dir), prepared=json.loads(Path(prepared).read_text())))


def _prepare(source: Path, work: Path) -> tuple[Path, float]:
    """The gguf target's prepare stage (once per source, shared by every GGUF export), and its seconds."""
    sys.path.insert(0, str(ROOT))
    from kiln.core.digest import HashCache
    from kiln.formats.hf_model import open_source
    from kiln.targets.gguf.export import prepare

    path = work / "prepared.json"
    hashes = HashCache(path.with_suffix(".hashes.json"))
    src = open_source(source, hasher=hashes.sha256)
    hashes.save()  # the stage has its source's digests from ingest: the timed runs do not hash
    t0 = time.perf_counter()
    path.write_text(json.dumps(prepare(src)))
    return path, time.perf_counter() - t0


def llama_cpp_converter(work: Path) -> Path:
    """The vendored llama.cpp of the pinned llama-cpp-python's sdist (converter, conversion/, gguf-py), unpacked
    under --work (`tests/llama_cpp_converter.py`, which the GGUF tests check kiln against too)."""
    sys.path.insert(0, str(ROOT))
    from tests.llama_cpp_converter import vendored_llama_cpp

    return vendored_llama_cpp(work)


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run `command`; its wall seconds and its own peak RSS in MB (what it wrote at exit)."""
    with tempfile.NamedTemporaryFile(prefix="peak-rss-") as peak:
        t0 = time.perf_counter()
        proc = subprocess.run(command, env={**env, "BENCH_PEAK_RSS_FILE": peak.name}, capture_output=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            stderr = proc.stderr.decode(errors="replace")
            raise RuntimeError(f"{' '.join(command[:4])}... exited {proc.returncode}: {stderr[-2000:]}")
        return wall, int(Path(peak.name).read_text()) / 1024


def _warm(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kiln-bench-gguf"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--quants", default="f16,q8_0")
    ap.add_argument("--repeat", type=int, default=2, help="runs per quant; the best is reported")
    add_record_argument(ap, "gguf_convert")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return

    shape = (args.hidden, args.intermediate, args.layers, args.vocab, args.heads, args.kv_heads)
    src = make_source(args.work / ("source-" + "-".join(map(str, shape))), *shape)  # one generated model per shape
    weights = sorted(src.glob("*.safetensors"))
    nbytes = _warm(weights)
    out = args.work / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    for p in weights:
        shutil.copyfile(p, out / p.name)
    cp_s = time.perf_counter() - t0
    shutil.rmtree(out)

    converter = llama_cpp_converter(args.work)
    prepared, prepare_s = _prepare(src, args.work)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    for quant in args.quants.split(","):
        kiln: dict[str, float] = {}
        peer: dict[str, float] = {}
        for _ in range(args.repeat):  # alternate, so both see the same machine state; keep each one's best
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            wall, rss = _timed([sys.executable, "-c", PEER_DRIVER, str(converter), str(src)]
                               + ["--outfile", str(out / "peer.gguf"), "--outtype", quant], env)  # fmt: skip
            if not peer or wall < peer["wall_s"]:
                peer = {"wall_s": wall, "peak_rss_mb": rss, "out_bytes": (out / "peer.gguf").stat().st_size}
            shutil.rmtree(out)
            wall, rss = _timed([sys.executable, __file__, "--child", str(src), quant, str(out), str(prepared)], env)
            if not kiln or wall < kiln["wall_s"]:
                kiln = {"wall_s": wall, "peak_rss_mb": rss, "out_bytes": sum(f.stat().st_size for f in out.glob("*"))}
        for r in (kiln, peer):
            r["mb_s"] = nbytes / r["wall_s"] / 1e6
        rows.append({"quant": quant, "kiln": kiln, "peer": peer, "ratio": kiln["mb_s"] / peer["mb_s"]})
    shutil.rmtree(out, ignore_errors=True)

    print(f"source: {nbytes / 1e9:.2f} GB bf16, {len(weights)} shards; cp: {nbytes / cp_s / 1e6:.0f} MB/s")
    print(f"peer: llama.cpp convert_hf_to_gguf.py from {converter.parent.parent.name}, vocabulary step skipped")
    print(f"kiln: the export stage; the tokenizer metadata, read once per source by prepare/gguf: {prepare_s:.1f} s")
    head = f"{'quant':6} {'kiln MB/s':>10} {'peer MB/s':>10} {'ratio':>6} {'target':>7} {'kiln RSS MB':>12}"
    print(head + f" {'peer RSS MB':>12}")
    for r in rows:
        k, p = r["kiln"], r["peer"]
        print(
            f"{r['quant']:6} {k['mb_s']:10.0f} {p['mb_s']:10.0f} {r['ratio']:6.2f} {TARGET_X[r['quant']]:7.1f} "
            f"{k['peak_rss_mb']:12.0f} {p['peak_rss_mb']:12.0f}"
        )
    record = run_record(
        source_gb=nbytes / 1e9,
        cp_mb_s=nbytes / cp_s / 1e6,
        peer=converter.parent.parent.name,
        prepare_s=prepare_s,
        results=rows,
    )
    save_record(record, args.record)


if __name__ == "__main__":
    main()
