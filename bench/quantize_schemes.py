"""Benchmark: the quantize stage of every scheme on one release, time and peak memory per scheme.

    python bench/quantize_schemes.py [--source examples/tiny-llama/model] [--schemes fp8,int4-rtn,...]

Each scheme runs in a fresh process (so its peak RSS is its own) through the same code as the
`quantize/<scheme>` stage (`quant.store.write_quantized`, with llm-compressor
calibration for GPTQ/AWQ on the recipe's default calibration text: the held-out text after the
4,096 tokens the eval scores, 32 samples of 256 tokens). `import MB` is the peak after importing
what the scheme needs and before reading any weight, so `peak - import` is the work's own memory.
The run's record (command, host, load, results) is printed as JSON and appended to --record.
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


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(source: str, scheme_name: str, text_file: str, out_dir: str) -> None:
    """Quantize `source` under one scheme in this process; print wall time and memory as JSON."""
    sys.path.insert(0, str(ROOT))
    # Imported before the clock starts, so `import MB` and not the timing counts them.
    import compressed_tensors.compressors  # noqa: F401
    import torch  # noqa: F401

    from kiln.formats.hf_model import open_source
    from kiln.quant.catalog import get_scheme
    from kiln.quant.store import write_quantized

    scheme = get_scheme(scheme_name)
    if scheme.by_llmcompressor:
        import llmcompressor  # noqa: F401
        import llmcompressor.modifiers.gptq  # noqa: F401
        import llmcompressor.modifiers.quantization  # noqa: F401
        import llmcompressor.modifiers.transform.awq  # noqa: F401

        from kiln.quant.calibrated import calibrate, calibration_samples
    src = open_source(source)
    imported = _peak_rss_mb()
    t0 = time.perf_counter()
    calibrated = None
    if scheme.by_llmcompressor:  # GPTQ, AWQ and NVFP4's activation scales calibrate; the rest is data-free
        text = Path(text_file).read_text(encoding="utf-8")
        samples = (
            calibration_samples(src.root, text, samples=32, seq_len=256, skip_tokens=4096) if scheme.calibrated else []
        )
        calibrated = calibrate(
            src, scheme, samples, compute_dtype=os.environ.get("KILN_BENCH_COMPUTE_DTYPE", "float32")
        )
    summary = write_quantized(src, scheme, Path(out_dir), calibrated=calibrated)
    wall = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "scheme": scheme_name,
                "wall_s": round(wall, 3),
                "import_mb": round(imported, 1),
                "peak_rss_mb": round(_peak_rss_mb(), 1),
                "source_bytes": summary["source_bytes"],
                "stored_bytes": summary["stored_bytes"],
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=ROOT / "examples" / "tiny-llama" / "model")
    ap.add_argument("--text", type=Path, default=ROOT / "examples" / "tiny-llama" / "heldout.txt")
    ap.add_argument("--schemes", default="")
    add_record_argument(ap, "quantize_schemes")
    ap.add_argument(
        "--compute-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="calibration's (GPTQ/AWQ); default: this CPU's",
    )
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    sys.path.insert(0, str(ROOT))
    from kiln.quant.catalog import SCHEMES

    names = args.schemes.split(",") if args.schemes else [n for n, s in SCHEMES.items() if s.quantized]
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    if args.compute_dtype is None:
        sys.path.insert(0, str(ROOT))
        from kiln.quant.calibrated import calibration_dtype

        args.compute_dtype = calibration_dtype()
    env["KILN_BENCH_COMPUTE_DTYPE"] = args.compute_dtype
    for name in names:
        out = Path(tempfile.mkdtemp(prefix="kiln-bench-quantize-"))
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(args.source), name, str(args.text), str(out)],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            )
        finally:
            shutil.rmtree(out, ignore_errors=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    print(f"{'scheme':12} {'wall s':>7} {'import MB':>10} {'peak MB':>8} {'work MB':>8} {'stored / source':>16}")
    for r in rows:
        print(
            f"{r['scheme']:12} {r['wall_s']:7.2f} {r['import_mb']:10.0f} {r['peak_rss_mb']:8.0f} "
            f"{r['peak_rss_mb'] - r['import_mb']:8.0f} {r['stored_bytes'] / r['source_bytes']:16.3f}"
        )
    record = run_record(source=str(args.source), compute_dtype=args.compute_dtype, results=rows)
    save_record(record, args.record)


if __name__ == "__main__":
    main()
