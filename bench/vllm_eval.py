"""Benchmark: the example's bundles evaluated in vLLM beside transformers, from one fresh build.

    python bench/vllm_eval.py [--recipe examples/tiny-llama/kiln.yaml]

Runs `kiln build RECIPE --json` into an empty temporary work directory, so every eval runs, and reads
for each bundle that vLLM evaluates: KL and top-1 against the float32 reference in transformers and in
vLLM, and their differences (vLLM - transformers), and the vLLM eval stage's wall time. Then loads each
bundle once more in vLLM alone for its load time (the worker's start, vLLM's import, is timed apart:
a build pays it once). The runtime environment's size and install time come from its
`environment.json`. Both runtimes run in the same build, on the same windows, minutes apart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from record import add_record_argument, run_record, save_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _metrics(evals: list[dict[str, Any]], runtime: str) -> dict[str, Any] | None:
    return next((e for e in evals if e["runtime"] == runtime), None)


def main() -> None:
    from kiln.eval.runtimes import environments
    from kiln.eval.runtimes.vllm_runtime import VllmRuntime, shared_worker

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "examples/tiny-llama/kiln.yaml")
    add_record_argument(ap, "vllm_eval")
    args = ap.parse_args()
    installed = environments.find("vllm")
    if installed is None:
        sys.exit("vLLM's environment is not installed: kiln runtime install vllm")

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-vllm-") as tmp:
        cmd = [sys.executable, "-m", "kiln", "build", str(args.recipe), "--work-dir", str(Path(tmp) / "work")]
        started = time.perf_counter()
        proc = subprocess.run([*cmd, "--json"], cwd=ROOT, capture_output=True, text=True)
        build_s = time.perf_counter() - started
        if proc.returncode != 0:
            sys.exit(f"kiln build failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        report = json.loads(proc.stdout)
        t0 = time.perf_counter()
        shared_worker(installed.python)
        worker_start = time.perf_counter() - t0
        for artifact in report["artifacts"]:
            in_vllm = _metrics(artifact.get("evals", []), "vllm")
            if in_vllm is None:
                continue
            row: dict[str, Any] = {"artifact": artifact["artifact"], "bytes": artifact["size"]}
            row["vllm_status"] = in_vllm["status"]
            if in_vllm["status"] == "not_evaluated":
                row["reason"] = in_vllm["reason"]
                rows.append(row)
                continue
            t0 = time.perf_counter()
            rt = VllmRuntime(artifact["path"], max_model_len=512)
            row["vllm_load_s"] = round(time.perf_counter() - t0, 2)
            rt.close()
            hf = _metrics(artifact["evals"], "transformers")
            v, t = in_vllm["metrics"], hf["metrics"] if hf else None
            row |= {
                "vllm_eval_s": in_vllm["seconds"],
                "vllm_version": in_vllm["runtime_version"],
                "vllm_kl": v["kl"],
                "vllm_top1": v["top1"],
                "vllm_greedy": v["greedy_match"],
            }
            if t is not None:
                row |= {
                    "transformers_kl": t["kl"],
                    "transformers_top1": t["top1"],
                    "transformers_greedy": t["greedy_match"],
                    "transformers_eval_s": _metrics(artifact["evals"], "transformers")["seconds"],  # type: ignore[index]
                    "kl_diff": v["kl"] - t["kl"],
                    "top1_diff": v["top1"] - t["top1"],
                }
            rows.append(row)

    print(f"{'artifact':<22} {'KL tf':>9} {'KL vLLM':>9} {'ΔKL':>10} {'top1 tf':>8} {'top1 vLLM':>9} {'Δtop1':>8} "
          f"{'load s':>7} {'eval s':>7}")  # fmt: skip
    for r in rows:
        if r["vllm_status"] == "not_evaluated":
            print(f"{r['artifact']:<22} not evaluated in vLLM here: {r['reason']}")
            continue
        print(
            f"{r['artifact']:<22} {r.get('transformers_kl', float('nan')):>9.2e} {r['vllm_kl']:>9.2e} "
            f"{r.get('kl_diff', float('nan')):>+10.2e} {r.get('transformers_top1', float('nan')):>8.4f} "
            f"{r['vllm_top1']:>9.4f} {r.get('top1_diff', float('nan')):>+8.4f} {r['vllm_load_s']:>7.2f} "
            f"{r['vllm_eval_s']:>7.2f}"
        )
    vllm_stages = sum(s for n, s in report["stage_seconds"].items() if n.endswith("@vllm"))
    env = installed.record
    print(
        f"build {build_s:.1f} s, of which vLLM eval stages {vllm_stages:.1f} s; "
        f"vLLM worker start {worker_start:.1f} s; "
        f"environment {env['bytes'] / 2**30:.2f} GiB, installed in {env['install_seconds']} s ({env['version']})"
    )
    save_record(
        run_record(
            recipe=str(args.recipe.relative_to(ROOT) if args.recipe.is_relative_to(ROOT) else args.recipe),
            build_s=round(build_s, 2),
            vllm_stage_s=round(vllm_stages, 2),
            worker_start_s=round(worker_start, 2),
            environment={k: env[k] for k in ("version", "bytes", "install_seconds", "label")},
            bundles=rows,
        ),
        args.record,
    )


if __name__ == "__main__":
    main()
