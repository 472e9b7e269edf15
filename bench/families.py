"""The family probe: one tiny model per architecture family, each built with the same recipe of every target (GGUF
F16, Q8_0 and Q4_K_M; hf-bundle bf16, FP8, INT8-W8A8 and W4A16 GPTQ; orbax bf16), every artifact evaluated in each
runtime that serves it here (llama.cpp, transformers, vLLM's CPU build where installed, JAX), and one table of
KL, top-1 and perplexity change per family, artifact and runtime (docs/evaluation.md's "Each family").

The models are random (transformers' own classes, seeded; tests/model_factory.make_model), so the figures show
that each family is written, loaded and computed as its reference computes it (bf16 and F16 at KL ~0, the
quantized ones a small KL), not how well a family quantizes: that is the trained examples' job. Gates are not
applied to these figures (a random model's top token flips under any rounding); the build records them.

    python bench/families.py [--families qwen3,qwen3_moe] [--vllm]

Without `--vllm` vLLM's environment is pointed at an empty directory, and its evals are recorded not evaluated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from record import add_record_argument, run_record, save_record  # noqa: E402  (bench/record.py, beside this script)

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3")
# llama.cpp looks tokens up by the model's name (a name with "phi3" in it needs '<s>', '<unk>', '</s>'): the GGUF
# files are named apart from the recipe's model.
PARAMS: dict[str, dict[str, object]] = {"gguf": {"params": {"name": "probe"}}}
# Every Linear's input a multiple of GPTQ's 128-wide groups (the factory's Qwen3-MoE experts are 64 wide), and
# Gemma 3's attention scaled by its head_dim (32 here), as Gemma 3 1B-12B are and llama.cpp's gemma3 computes.
WIDTHS: dict[str, dict[str, int]] = {
    "qwen3_moe": {"moe_intermediate_size": 128},
    "gemma3": {"query_pre_attn_scalar": 32},
}
RECIPE_TARGETS = {
    "gguf": ["f16", "q8_0", "q4_k_m"],
    "hf-bundle": ["bf16", "fp8", "int8-w8a8", "w4a16-gptq"],
    "orbax": ["bf16"],
}
# Every gate wide open: the table reports, the build does not judge a random model (see the docstring).
OPEN_GATE = {"max_kl": 100.0, "min_top1": 0.0, "max_ppl_increase": 100.0}


def build(family: str, work: Path, vllm: bool) -> dict[str, Any]:
    from kiln.formats.architectures import FAMILIES as RECORDS
    from tests.model_factory import make_model

    make_model(work / "model", family, hidden_size=128, intermediate_size=256, vocab_size=512, **WIDTHS.get(family, {}))
    held_out = (ROOT / "examples" / "tiny-llama" / "heldout.txt").read_text()
    (work / "heldout.txt").write_text(held_out[:40000])
    (work / "calibration.txt").write_text((ROOT / "examples" / "tiny-llama" / "train.py").read_text())
    arch = RECORDS[family]
    targets = [
        {"target": t, "quants": q, **PARAMS.get(t, {})}
        for t, q in RECIPE_TARGETS.items()
        if t == "hf-bundle" or arch.target(t).supported
    ]
    quants = [q for t in targets for q in t["quants"]]
    recipe = {
        "model": f"probe-{family.replace('_', '-')}",
        "version": "1.0.0",
        "source": "model",
        "eval": {
            "text": "heldout.txt",
            "max_tokens": 2048,
            "window": 256,
            "gates": {q: OPEN_GATE for q in quants},
        },
        "calibration": {"text": "calibration.txt", "samples": 16, "seq_len": 128},
        "targets": targets,
    }
    (work / "kiln.yaml").write_text(json.dumps(recipe))
    env = {**os.environ, "KILN_WORK_DIR": str(work / "work"), "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    if not vllm:
        env["KILN_RUNTIMES"] = str(work / "no-runtimes")
    kiln = [str(Path(sys.executable).parent / "kiln")]
    start = time.perf_counter()
    proc = subprocess.run([*kiln, "build", str(work / "kiln.yaml"), "--json"], capture_output=True, text=True, env=env)
    if proc.returncode not in (0, 3):  # 3: a gate failed (none can: every gate is open)
        raise SystemExit(f"kiln build of {family} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    built = json.loads(proc.stdout)
    rows = []
    for artifact in built["artifacts"]:
        for ev in artifact["evals"]:
            m = ev.get("metrics") or {}
            rows.append(
                {
                    "artifact": artifact["artifact"],
                    "runtime": ev["runtime"],
                    "status": ev["status"],
                    "kl": m.get("kl"),
                    "top1": m.get("top1"),
                    "ppl_change": m.get("ppl_change"),
                    "reason": ev.get("reason"),
                }
            )
    return {"family": family, "seconds": round(time.perf_counter() - start, 1), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--vllm", action="store_true", help="evaluate the bundles in vLLM's CPU build too")
    add_record_argument(ap, "families")
    args = ap.parse_args()
    results = []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory(prefix=f"kiln-family-{family}-") as tmp:
            results.append(build(family, Path(tmp), args.vllm))
    print(f"{'family':<10} {'artifact':<22} {'runtime':<13} {'KL':>9} {'top-1':>6} {'ppl +':>8}")
    for result in results:
        for r in result["rows"]:
            if r["status"] == "not_evaluated":
                print(f"{result['family']:<10} {r['artifact']:<22} {r['runtime']:<13} not evaluated: {r['reason']}")
                continue
            ppl = f"{100 * r['ppl_change']:+.2f}%" if r["ppl_change"] is not None else "-"
            print(
                f"{result['family']:<10} {r['artifact']:<22} {r['runtime']:<13} "
                f"{r['kl']:>9.2e} {r['top1']:>6.3f} {ppl:>8}"
            )
    save_record(run_record(vllm=args.vllm, results=results), args.record)


if __name__ == "__main__":
    main()
