"""Benchmark: peak host memory of calibrated quantization (GPTQ, AWQ) against model depth.

    python bench/calibration_memory.py [--layers 4,8,16] [--schemes w4a16-gptq,w4a16-awq]
        [--hidden 512 --intermediate 1408 --heads 8 --kv-heads 4 --vocab 512] [--samples 4 --seq-len 64]
        [--repeat 1] [--threads N]

Writes random Llama-shaped bf16 models of the same layer width and increasing depth once under
--work, one tensor at a time (so Llama-3-8B's width and 128,256-token vocabulary fit), then runs the
quantize stage's calibrated path (`calibration_samples` -> `calibrate` -> `write_quantized`, as
`pipeline/stages/quantize.py` does) for each (depth, scheme) in a fresh process, and prints a table:
model and one-layer sizes, peak RSS (VmHWM), peak minus the process's RSS after importing torch /
transformers / datasets / llm-compressor (the import baseline), the same for anonymous memory alone
(RssAnon, sampled every 10 ms: VmHWM also counts mapped file pages, the source's and the offload
folder's, which the kernel reclaims under pressure), wall and CPU time. If memory is bounded by
about one layer, the growth column stays flat as depth grows; if the whole model is held, it grows
by at least one layer's bytes per layer. On a shared machine use --threads 1: with torch's default
threads the times swing several-fold with the load. The run's record (command, host, load, commit,
results with each phase's peak) is printed as JSON and appended to --record.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from random_model import write_weights  # noqa: E402 (beside this script)
from record import add_record_argument, run_record, save_record  # noqa: E402 (bench/record.py, beside this script)

from kiln.core.usage import MemorySampler, reset_peak, status_kb  # noqa: E402

MB = 1e6


def _vm_kb(field: str) -> int:
    """VmHWM / VmRSS / RssAnon of this process; VmHWM starts afresh at exec, unlike ru_maxrss across fork+exec."""
    return status_kb(field) or 0


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _calibration_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((stdlib / n).read_text(encoding="utf-8") for n in ("argparse.py", "typing.py"))


def make_source(out: Path, layers: int, args: argparse.Namespace) -> Path:
    """A random Llama-shaped bf16 release with a real tokenizer (written once, reused across runs).

    Tokenizer and config come from the test factory (`make_model` at a tiny width, the tokenizer trained
    for --vocab); the weights are `random_model.write_weights`' (one tensor in memory at a time).
    """
    if (out / "model.safetensors.index.json").is_file():
        return out
    from tests.model_factory import make_model

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_model(
        tmp, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=args.vocab
    )
    for f in tmp.glob("model*.safetensors*"):
        f.unlink()
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.update(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        vocab_size=args.vocab,
    )
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))

    write_weights(tmp, cfg)
    shutil.rmtree(out, ignore_errors=True)  # one written by an earlier version of this script (a single file)
    tmp.rename(out)
    return out


def _child(source: str, scheme_name: str, samples: int, seq_len: int, dtype: str) -> None:
    """Run the quantize stage's calibrated path in this process; print timings and memory as JSON."""
    from kiln.quant.calibrated import _quiet_llmcompressor_logs

    _quiet_llmcompressor_logs()
    # Everything calibration imports, so the baseline is the libraries' own footprint.
    import datasets  # noqa: F401
    import llmcompressor  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from kiln.formats.hf_model import open_source
    from kiln.quant.calibrated import calibrate, calibration_samples
    from kiln.quant.catalog import get_scheme
    from kiln.quant.store import write_quantized

    baseline_kb = _vm_kb("VmHWM")
    baseline_anon_kb = _vm_kb("RssAnon")
    scheme = get_scheme(scheme_name)
    src = open_source(source)
    model_bytes = sum(t.nbytes for t in src.tensors.values())
    layer_bytes = sum(t.nbytes for n, t in src.tensors.items() if n.startswith("model.layers.0."))
    ids = calibration_samples(src.root, _calibration_text(), samples=samples, seq_len=seq_len)
    c0, t0 = _cpu_s(), time.perf_counter()
    with MemorySampler() as anon:
        calibrated = calibrate(src, scheme, ids, compute_dtype=dtype)
        t1 = time.perf_counter()
        calibrate_peak_kb = _vm_kb("VmHWM")
        phases = reset_peak()
        with tempfile.TemporaryDirectory(prefix="kiln-bench-calib-") as out:
            write_quantized(src, scheme, Path(out), calibrated=calibrated)
    t2 = time.perf_counter()
    write_peak_kb = _vm_kb("VmHWM") if phases else None
    print(
        json.dumps(
            {
                "scheme": scheme_name,
                "layers": json.loads((Path(source) / "config.json").read_text())["num_hidden_layers"],
                "model_bytes": model_bytes,
                "layer_bytes": layer_bytes,
                "compute_dtype": dtype,
                "import_rss_mb": baseline_kb * 1024 / MB,
                "import_anon_mb": baseline_anon_kb * 1024 / MB,
                "peak_anon_mb": anon.peak_anon_kb * 1024 / MB,
                "peak_rss_mb": max(calibrate_peak_kb, write_peak_kb or 0) * 1024 / MB,
                "calibrate_peak_rss_mb": calibrate_peak_kb * 1024 / MB,
                "write_peak_rss_mb": write_peak_kb * 1024 / MB if write_peak_kb else None,
                "calibrate_s": t1 - t0,
                "write_s": t2 - t1,
                "cpu_s": _cpu_s() - c0,
            }
        )
    )


def _run_child(src: Path, scheme: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            str(src),
            scheme,
            str(args.samples),
            str(args.seq_len),
            args.compute_dtype,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})},
        check=False,
    )
    if proc.returncode != 0:
        sys.exit(f"{scheme} on {src.name} failed:\n{proc.stderr[-4000:]}")
    r: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    r["process_s"] = time.perf_counter() - t0
    return r


def _commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--", "quant/calibrated.py")
    return git("rev-parse", "--short", "HEAD") + ("+calibrated.py modified" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kiln-bench-calibration")
    ap.add_argument("--layers", default="4,8,16")
    ap.add_argument("--schemes", default="w4a16-gptq,w4a16-awq")
    # Widths are multiples of the int4 group (128) so every Linear is quantized.
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="runs per (depth, scheme): best time, highest peak")
    # On a shared machine, torch's default threads spin-wait for each other and time means little; 1 is steady.
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for the runs (default: torch's)")
    add_record_argument(ap, "calibration_memory")
    ap.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16"], help="default: this CPU's")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        source, scheme, samples, seq_len, dtype = args.child
        _child(source, scheme, int(samples), int(seq_len), dtype)
        return

    if args.compute_dtype is None:
        from kiln.quant.calibrated import calibration_dtype

        args.compute_dtype = calibration_dtype()
    shape = f"h{args.hidden}-i{args.intermediate}-a{args.heads}-kv{args.kv_heads}-v{args.vocab}"
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        src = make_source(args.work / f"{shape}-l{layers}", layers, args)
        for scheme in args.schemes.split(","):
            runs = [_run_child(src, scheme, args) for _ in range(args.repeat)]
            # Time: the best run (the machine is shared); memory: the highest peak seen.
            r = min(runs, key=lambda x: x["calibrate_s"] + x["write_s"])
            r["peak_rss_mb"] = max(x["peak_rss_mb"] for x in runs)
            r["growth_mb"] = max(x["peak_rss_mb"] - x["import_rss_mb"] for x in runs)
            r["anon_growth_mb"] = max(x["peak_anon_mb"] - x["import_anon_mb"] for x in runs)
            r["runs"] = len(runs)
            rows.append(r)
            print(f"  {scheme} {layers} layers: peak {r['peak_rss_mb']:.0f} MB", file=sys.stderr)

    print(f"calibration computes in {args.compute_dtype}; anon: anonymous memory (RssAnon), without mapped files")
    head = ("scheme", "layers", "model MB", "layer MB", "peak RSS MB", "- imports", "anon - imports", "time s", "CPU s")
    print("{:11} {:>6} {:>9} {:>9} {:>12} {:>10} {:>15} {:>7} {:>7}".format(*head))
    for r in rows:
        print(
            f"{r['scheme']:11} {r['layers']:6d} {r['model_bytes'] / MB:9.0f} {r['layer_bytes'] / MB:9.1f} "
            f"{r['peak_rss_mb']:12.0f} {r['growth_mb']:10.0f} {r['anon_growth_mb']:15.0f} "
            f"{r['calibrate_s'] + r['write_s']:7.1f} {r['cpu_s']:7.1f}"
        )
    record = run_record(
        commit=_commit(),
        shape=shape,
        samples=args.samples,
        seq_len=args.seq_len,
        threads=args.threads or None,
        compute_dtype=args.compute_dtype,
        results=rows,
    )
    save_record(record, args.record)


if __name__ == "__main__":
    main()
