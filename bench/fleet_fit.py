"""Sizing: one model's replica on each hardware of the fleet, per quant and load, from its config alone.

    python bench/fleet_fit.py [--config examples/llama-3-70b/config.json] [--context 32768]
        [--concurrency 1 16] [--quants bf16 fp8 w4a16-awq] [--hardware h100 h200 mi300x mi355x tpu-v5e]

For each hardware × quant × concurrency: the checkpoint's weight bytes (`quant.footprint`, exact
for kiln's compressed-tensors bundles), the tensor-parallel degree `placement.fit.plan_replica`
chooses, the memory per device (weights + KV cache), the decode bound (tokens/s for the replica and per
sequence), the time-to-first-token bound for one prompt of `--context` tokens, and USD per million
output tokens at the decode bound. A combination no kiln target serves (`targets` compatibility:
TPUs take orbax bf16 / int8-w8a16 only, FP8 needs FP8 units) is marked with the reason, not sized.
No hardware is used: these are bounds from the catalog's data-sheet figures (`core/hardware.yaml`), each scaled by
the share of it measured on that SKU where its entry has a `measured` record (H200's).
Prints a markdown table and appends the run's record to --record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 1024**3


def served_by(quant: str, hardware: str) -> tuple[list[str], str]:
    """The targets whose artifact for `quant` runs on `hardware`, and (when none) what it is served instead."""
    from kiln.core.errors import KilnError
    from kiln.targets.base import all_targets

    targets, instead = [], []
    for spec in all_targets().values():
        try:
            verdicts = {q: spec.compatibility(q).get(hardware) for q in spec.quants if q not in spec.unsupported_quants}
        except KilnError:  # a target that needs a recipe's params to say (rocm-bundle: the gfx arch)
            continue
        runs = [q for q, v in verdicts.items() if v is not None and v.compatible]
        if quant in runs:
            targets.append(spec.name)
        elif runs:
            instead.append(f"{spec.name} {' / '.join(runs)}")
    return targets, f"{hardware} is served {'; '.join(instead) or 'nothing'}"


def main() -> None:
    from kiln.core.hardware import PROFILES
    from kiln.core.shape import ShapeRecord
    from kiln.placement.fit import plan_replica
    from kiln.quant.footprint import checkpoint_bytes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples/llama-3-70b/config.json")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--quants", nargs="+", default=["bf16", "fp8", "w4a16-awq"])
    ap.add_argument("--hardware", nargs="+", default=["h100", "h200", "mi300x", "mi355x", "tpu-v5e"])
    ap.add_argument("--kv-dtype", default="bf16")
    add_record_argument(ap, "fleet_fit")
    args = ap.parse_args()

    config = json.loads(args.config.read_text())
    shape = ShapeRecord.from_untrusted(config)
    weights = {q: checkpoint_bytes(config, q) for q in args.quants}
    rows: list[dict[str, Any]] = []
    lines = [
        "| hardware | quant | concurrency | weights | TP | per device: weights + KV "
        "| decode tok/s (replica / per sequence) | TTFT bound | USD / M tokens |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for hw in args.hardware:
        profile = PROFILES[hw]
        for quant in args.quants:
            targets, why_not = served_by(quant, hw)
            for n in args.concurrency:
                row: dict[str, Any] = {
                    "hardware": hw,
                    "quant": quant,
                    "concurrency": n,
                    "weights_bytes": weights[quant],
                }
                head = f"| {hw} | {quant} | {n} | {weights[quant] / GIB:.1f} GiB"
                if not targets:
                    row["served"] = False
                    row["reason"] = why_not
                    lines.append(f"{head} | — | no kiln artifact: {why_not} | | | |")
                    rows.append(row)
                    continue
                plan = plan_replica(profile, shape, weights[quant], quant, args.context, n, kv_dtype=args.kv_dtype)
                fields = {k: v for k, v in vars(plan).items() if k not in ("hardware", "basis")}
                row |= {"served": True, "targets": targets, **fields, "basis": plan.basis.model_dump(mode="json")}
                rows.append(row)
                per_device = f"{plan.weights_per_device_bytes / GIB:.1f} + {plan.kv_per_device_bytes / GIB:.1f} GiB"
                if not plan.fits:
                    need = plan.required_per_device_bytes / GIB
                    usable = plan.usable_per_device_bytes / GIB
                    lines.append(
                        f"{head} | — | {per_device} at TP {plan.tp} | does not fit in {plan.max_tp} devices "
                        f"({need:.1f} > {usable:.1f} GiB usable) | | |"
                    )
                    continue
                ttft = f"{plan.ttft_s:.2f} s" if plan.ttft_s is not None else "—"
                cost = f"{plan.cost_per_mtok:.2f}" if plan.cost_per_mtok is not None else "—"
                lines.append(
                    f"{head} | {plan.tp} | {per_device} | {plan.decode_tokens_per_s:,.0f} / "
                    f"{plan.decode_tokens_per_s_per_sequence:,.1f} | {ttft} | {cost} |"
                )
    shown = args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
    print(f"{shown}, context {args.context}")
    print("\n".join(lines))
    save_record(
        run_record(
            config=str(args.config),
            context=args.context,
            kv_dtype=args.kv_dtype,
            shape=shape.model_dump(mode="json") if not isinstance(shape, str) else shape,
            rows=rows,
        ),
        args.record,
    )


if __name__ == "__main__":
    main()
