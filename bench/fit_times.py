"""Fit the plan's time estimates to a measured run: each kind of stage's wall time on the build host as a line over its
floor (`placement.cost`: `fixed_s + per_floor x floor`).

    python bench/fit_times.py [--when WHEN] [--record FILE]

Reads one `bench/scale.py` run from bench/results/scale.jsonl (the newest with the plan's floor beside each stage,
or the one recorded at WHEN): every stage it built at every size, its measured wall seconds and the floor its plan
gave before it ran. Per kind of stage (`pipeline.requirements.stage_kind`, named here from the node the same way:
`eval:vllm:fp8`) and per kind it falls back to (`eval:vllm`, `eval`), it fits `fixed_s` and `per_floor` by least
squares on the relative error (a 10 s stage counts as much as a 10 min one), `fixed_s` and `per_floor` at least 0;
with a single floor it takes the line through the origin. It prints, per kind, the line, the points and each point's
error, and the Python to paste into `placement/cost.py`'s `BUILD_HOST_TIMES`; the fit is recorded in
bench/results/plan_times.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import RESULTS, add_record_argument, run_record, save_record  # noqa: E402 (beside this script)


def kind(node: str) -> str:
    """`pipeline.requirements.stage_kind` of a `bench/scale.py` node from its id (`export/gguf-q4_k_m`,
    `eval/hf-bundle-fp8@vllm`), for a run whose plan rows did not say (before 2026-11-29): the stage, what does the
    work (a calibrated quantize, the export's target, the eval's runtime) and the quant."""
    from kiln.formats.gguf.constants import QUANTS as GGUF_QUANTS
    from kiln.quant.catalog import get_scheme
    from kiln.targets.base import all_targets, get_target

    stage, _, rest = node.partition("/")
    if stage == "quantize":
        return f"quantize{':calibrated' if get_scheme(rest).calibrated else ''}:{rest}"
    if stage not in ("export", "eval"):
        return stage
    artifact, _, runtime = rest.partition("@")
    target = max((t for t in all_targets() if artifact.startswith(t + "-")), key=len)
    quant = artifact[len(target) + 1 :]
    spec = get_target(target)
    if stage == "eval":
        return f"eval:{runtime or spec.runtime}:{quant}"
    gguf = GGUF_QUANTS.get(quant) if spec.runtime == "llama.cpp" else None
    return f"export:{target}" + ("-llama.cpp" if gguf is not None and gguf.llama_ftype else "") + f":{quant}"


def levels(kind: str) -> list[str]:
    """`eval:vllm:fp8`, `eval:vllm`, `eval`: every kind an estimate may fall back to, most specific first."""
    parts = kind.split(":")
    return [":".join(parts[:n]) for n in range(len(parts), 0, -1)]


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed_s, per_floor) minimising the squared relative error over (floor, wall) points, both at least 0."""
    floors = np.array([f for f, _ in points])
    walls = np.array([w for _, w in points])
    w = 1 / walls
    if len(set(floors.round(1))) > 1:
        a = np.stack([np.ones_like(floors), floors], axis=1) * w[:, None]
        fixed, slope = np.linalg.lstsq(a, walls * w, rcond=None)[0]
        if fixed >= 0 and slope >= 0:
            return float(fixed), float(slope)
        if slope < 0:  # the floor does not explain it: a constant (the relative-error mean)
            return float(np.sum(w) / np.sum(w * w)), 0.0
    if not floors.any():
        return float(np.sum(w) / np.sum(w * w)), 0.0
    slope = float(np.sum(w * w * floors * walls) / np.sum(w * w * floors * floors))  # through the origin
    return 0.0, slope


def load_run(path: Path, when: str | None) -> dict[str, Any]:
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    usable = [
        r
        for r in runs
        if (when is None or r["when"] == when) and any("planned_s" in s for x in r["results"] for s in x["stages"])
    ]
    if not usable:
        sys.exit(f"no run in {path} has the plan's floor beside its stages" + (f" at {when}" if when else ""))
    return usable[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=Path, default=RESULTS / "scale.jsonl", help="bench/scale.py's records")
    ap.add_argument("--when", help="the run to fit (its `when`); default: the newest that can be")
    add_record_argument(ap, "plan_times")
    args = ap.parse_args()
    run = load_run(args.scale, args.when)

    points: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for result in run["results"]:
        for row in result["stages"]:
            if row.get("planned_s") is None or row.get("eval_status") == "not_evaluated":
                continue  # an eval whose runtime is not here did no work to time
            if row["wall_s"] < 0.01 * row["planned_s"]:
                continue  # it did none of the work its floor counts (an ingest whose hashes were already known)
            point = {"node": row["node"], "size": result["size"], "floor_s": row["planned_s"], "wall_s": row["wall_s"]}
            for k in levels(row.get("kind") or kind(row["node"])):  # the kind, and each it falls back to
                points[k].append(point)
    fitted = {}
    print(f"stage times over the plan's floor, fitted to bench/scale.py's run of {run['when']} ({run['commit']}):")
    print(f"{'kind':26} {'fixed s':>8} {'x floor':>8}   node (size): floor s -> wall s, the line's error")
    for k in sorted(points):
        pts = points[k]
        fixed, per_floor = fit([(p["floor_s"], p["wall_s"]) for p in pts])
        pts = [{**p, "estimate_s": round(fixed + per_floor * p["floor_s"], 1)} for p in pts]
        for p in pts:
            p["error"] = round(p["estimate_s"] / p["wall_s"] - 1, 3)
        fitted[k] = {"fixed_s": round(fixed, 1), "per_floor": round(per_floor, 2), "points": pts}
        print(f"{k:26} {fixed:8.1f} {per_floor:8.2f}")
        for p in pts:
            print(f"{'':44} {p['node']} ({p['size']}): {p['floor_s']:.1f} -> {p['wall_s']:.1f}  {p['error']:+.0%}")
    # A stage's own line only where its work is of one kind (the reference): an eval's or an export's depends on
    # its runtime or writer, and a kind not measured here is estimated by its floor, not by another's line.
    fitted = {k: f for k, f in fitted.items() if ":" in k or not any(o.startswith(k + ":") for o in fitted)}
    print("\nBUILD_HOST_TIMES: dict[str, StageTime] = {")
    for k, f in fitted.items():
        print(f'    "{k}": StageTime({f["fixed_s"]}, {f["per_floor"]}),')
    print("}")
    save_record(run_record(scale_run=run["when"], scale_commit=run["commit"], fitted=fitted), args.record)


if __name__ == "__main__":
    main()
