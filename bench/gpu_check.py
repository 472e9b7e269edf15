"""One prepared check for a GPU machine: kiln's compute stages on CUDA against the same on the CPU.

    python bench/gpu_check.py --out $OUT                           # on the GPU machine, from the repo root
    python bench/gpu_check.py --device cpu --quick --out /tmp/gc   # anywhere: the same flow, CUDA parts skipped

The GPU machine is offline and bare (torch, transformers, JAX with CUDA, orbax; not kiln's other
dependencies), so the script first sets itself up from the wheels `bench/gpu_wheels.sh` downloaded
into `.wheelhouse/gpu/` (carried with the working tree): it installs, with `pip --no-index --no-deps
--target`, only those of `.wheelhouse/gpu/requirements.txt` that the machine's Python lacks (what it
has, it keeps: its torch and JAX were built against it), puts them and the checkout on PYTHONPATH, and
runs itself again. Then, each step in its own process with its own timeout, so one failure (or a hang)
is recorded and the rest still run, inside one overall budget (`--budget`, 270 s by default):

1. `info`: the GPU, its driver, torch / transformers / JAX versions and JAX's devices.
   `probe`: `bench/hardware_probe.py` on the device before anything else runs there (the shares of its
   catalog peaks it reaches: memory read, decode chains in bf16 and FP8, GEMMs per type, allocatable
   memory; what `kiln hardware probe` measures), its table printed and its record kept here.
2. `build-cuda` and `build-cpu`, at the same time: the example (examples/tiny-llama) with a recipe
   restricted to the targets whose runtimes are there (hf-bundle: bf16, fp8, fp8-block, int8-w8a8,
   int8-w8a16, int4-rtn, w4a16-gptq, w4a16-awq; orbax: bf16, int8-w8a16; gguf when llama.cpp imports),
   built with `--device cuda` (calibration, the reference, the transformers and JAX evals on the GPU)
   and with `--device cpu`, each in its own work directory; then a table of every artifact's metrics on
   both (KL, ppl change, top-1) and of the two references against each other.
3. `kernels`: the fp8, fp8-block and int8-w8a8 bundles of the CUDA build through the real tensor-core
   matmuls (`torch._scaled_mm` row-wise and block-wise, `torch._int_mm`; `eval.native_kernels`),
   and through their float32 emulation, the rest of the model in float32 in both: each one's KL against
   the build's reference, their relative difference, and the KL between the two. With `--device cpu`
   the same code runs with the float32 stand-in kernels.
4. `gptq-layer`: GPTQ calibration (`quant.calibrated.calibrate`, llm-compressor's sequential pipeline)
   of one 8B-shaped decoder layer (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, random
   weights, 512 calibration tokens) on the device, timed. `--quick` uses a small layer.

`--scale 8b` runs instead (after `info`) `bench/scale.py` at that size on the device, in its own budget:
a random-weight model of Llama-3-8B's shape generated there, and one artifact (hf-bundle FP8, or INT4
round-to-nearest where the disk has too little room for FP8's two copies: `SCALE_TARGETS`) built with
`--device cuda`: ingest, the layer-streamed reference and the transformers eval on the GPU, FP8
quantization and the export streamed on the CPU; each stage's time, host and GPU memory (its table and
record go into this record).

One JSON record (bench/record.py's fields, then each step's) is written to `<out>/gpu_check.jsonl`,
rewritten after every step, so a run cut short still leaves what it measured; `--record` also appends
it to bench/results/gpu_check.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from record import RESULTS, run_record  # noqa: E402 (bench/record.py, beside this script)

WHEELHOUSE = ROOT / ".wheelhouse" / "gpu"
EXAMPLE = ROOT / "examples" / "tiny-llama"
SETUP_ENV = "KILN_GPU_CHECK_SETUP"  # set once the wheels are installed: the script runs itself again
HF_BUNDLE = ["bf16", "fp8", "fp8-block", "int8-w8a8", "int8-w8a16", "int4-rtn", "w4a16-gptq", "w4a16-awq"]
HF_BUNDLE_QUICK = ["fp8", "fp8-block", "int8-w8a8", "w4a16-gptq"]
ORBAX = ["bf16", "int8-w8a16"]
GGUF = ["f16", "q8_0", "q4_k_m"]
KERNEL_SCHEMES = ("fp8", "fp8-block", "int8-w8a8")
# Seconds each step may take at most (the overall budget cuts them shorter).
STEP_LIMITS = {"info": 60, "probe": 90, "build": 200, "kernels": 90, "gptq-layer": 120, "scale": 560}
# One artifact at 8B: the model, its ingested copy and the FP8 bundle (with its quantize stage's output) take
# ~50 GB; where the disk has less free, INT4 round-to-nearest (~41 GB).
SCALE_TARGETS = (("hf-bundle-fp8", 56e9), ("hf-bundle-int4-rtn", 0.0))
# bench/scale.py's 128,256-token tokenizer, trained on this checkout's Python library and carried in the
# wheelhouse (`bench/gpu_wheels.sh` copies it there): the GPU image's library gives too few merges.
TOKENIZER = "tokenizer-128256"


# --- setup: the wheels this machine lacks -------------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def setup(argv: list[str]) -> None:
    """Install the missing wheels into a fresh target directory and run this script again with them (and the
    checkout) on PYTHONPATH; a no-op once done, or without a wheelhouse."""
    if os.environ.get(SETUP_ENV):
        return
    started = time.time()
    env = dict(os.environ)
    info: dict[str, Any] = {"wheelhouse": str(WHEELHOUSE.relative_to(ROOT))}
    # A path with "site-packages" in it: dill (datasets' fingerprints) pickles modules elsewhere by value.
    site = Path(tempfile.gettempdir()) / "kiln-gpu-check" / "site-packages"
    reqs = WHEELHOUSE / "requirements.txt"
    if reqs.is_file():
        present = {
            _norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions() if d.metadata["Name"]
        }
        wanted = [line.split("==") for line in reqs.read_text().split() if "==" in line]
        missing = [f"{n}=={v}" for n, v in wanted if _norm(n) not in present]
        info["installed"] = missing
        info["kept"] = {n: present[_norm(n)] for n, v in wanted if _norm(n) in present and present[_norm(n)] != v}
        shutil.rmtree(site, ignore_errors=True)
        if missing:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            pip += ["--disable-pip-version-check", "--target", str(site), "--find-links", str(WHEELHOUSE)]
            try:
                done = subprocess.run([*pip, *missing], capture_output=True, text=True, timeout=120)
                info["pip_rc"] = done.returncode
                if done.returncode != 0:
                    info["pip_error"] = done.stderr[-2000:]
            except subprocess.TimeoutExpired:
                info["pip_error"] = "pip install timed out after 120 s"
    else:
        info["missing"] = "no .wheelhouse/gpu/requirements.txt: run bench/gpu_wheels.sh first; using this Python as is"
    info["seconds"] = round(time.time() - started, 1)
    paths = [str(site), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env[SETUP_ENV] = json.dumps(info)
    env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Two builds share the GPU machine (and JAX's CPU build would otherwise take 75% of the GPU's memory).
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


# --- the steps (each runs in its own process: `--step NAME --step-out FILE`) -----------------------------


def step_info(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    import torch

    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        out["capability"] = f"sm{props.major}{props.minor}"
    for dist in ("transformers", "jax", "jaxlib", "orbax-checkpoint", "compressed-tensors", "llmcompressor"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    try:
        import jax

        out["jax_backend"] = jax.default_backend()
        out["jax_devices"] = [str(d) for d in jax.devices()]
    except Exception as e:
        out["jax_error"] = f"{type(e).__name__}: {e}"
    from kiln.core.device import describe, resolve_device

    out["device"] = describe(resolve_device(args.device))
    return out


def step_probe(args: argparse.Namespace) -> dict[str, Any]:
    """bench/hardware_probe.py on the device (`kiln hardware probe`'s measurement), with its table."""
    from hardware_probe import probe, table  # bench/hardware_probe.py, beside this script

    doc = probe(args.device)
    return {**doc, "table": "\n".join(table(doc))}


def _recipe(args: argparse.Namespace, work: Path) -> Path:
    """The example's recipe restricted to the targets whose runtimes this machine has."""
    targets: list[dict[str, Any]] = [{"target": "hf-bundle", "quants": HF_BUNDLE_QUICK if args.quick else HF_BUNDLE}]
    orbax = {
        "target": "orbax",
        "quants": ORBAX[:1] if args.quick else ORBAX,
        "params": {"mesh": {"data": 2, "model": 4}},
    }
    targets.append(orbax)
    try:
        import llama_cpp  # noqa: F401

        targets.append({"target": "gguf", "quants": GGUF[:1] if args.quick else GGUF})
    except Exception:  # no llama.cpp build for this Python: no GGUF artifact (recorded in the step)
        pass
    recipe = {
        "model": "tiny-llama",
        "version": "1.0.0",
        "description": "gpu_check variant of examples/tiny-llama",
        "source": str(EXAMPLE / "model"),
        "eval": {"text": str(EXAMPLE / "heldout.txt"), "max_tokens": 512 if args.quick else 4096, "window": 256},
        "targets": targets,
    }
    if args.quick:
        recipe["calibration"] = {"samples": 4, "seq_len": 64}
    path = work / "kiln.yaml"
    path.write_text(json.dumps(recipe, indent=2))  # JSON is YAML
    return path


class _Progress:
    """Each stage as it finishes, in the step's log (what a step cut short had done)."""

    def __init__(self, started: float) -> None:
        self.started = started

    def start(self, node: Any, key: str) -> None:
        pass

    def progress(self, advance: int, total: int | None) -> None:
        pass

    def finish(self, outcome: Any) -> None:
        print(
            f"{time.time() - self.started:7.1f}s {outcome.node.id}: {outcome.status} ({outcome.seconds:.1f}s)",
            flush=True,
        )


def step_build(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.pipeline import build
    from kiln.pipeline.recipe import load_recipe
    from kiln.pipeline.store import open_store

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(_recipe(args, work), allowed_roots=[EXAMPLE])
    started = time.time()
    result = build.run(recipe, open_store(None, work / "store"), device=args.device, reporter=_Progress(started))
    summary = result.summary()
    devices = {
        node_id: o.output.provenance.get("device")
        for node_id, o in result.outcomes.items()
        if o.output is not None and "device" in o.output.provenance
    }
    ref = result.outcomes["reference/source"].output
    bundles = {
        o.node.params["quant"]: str(o.output.files_dir)
        for o in result.outcomes.values()
        if o.output is not None and o.node.id.startswith("export/hf-bundle-")
    }
    return {
        "device": args.device,
        "seconds": round(time.time() - started, 1),
        "targets": [t.target + ":" + ",".join(t.quants) for t in recipe.targets],
        "stages": summary.stages,
        "stage_seconds": summary.stage_seconds,
        "failed_gates": summary.failed_gates,
        "artifacts": [
            {
                "artifact": r.artifact,
                "eval": r.eval,
                "evals": [
                    e.model_dump(mode="json", include={"runtime", "status", "metrics", "reason"}) for e in r.evals
                ],
            }
            for r in summary.artifacts
        ],
        "devices": devices,
        "reference_dir": str(ref.files_dir) if ref is not None else None,
        "bundles": bundles,
    }


def step_kernels(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.eval.native_kernels import Kernels, KernelUnavailable, check_kernels
    from kiln.pipeline.records import ReferenceRecord
    from kiln.pipeline.stage import STAGE_FILE, StageOutput
    from kiln.pipeline.stages.reference import stored_reference

    bundles = json.loads(args.bundles)
    # The reference the build's evals scored against: the source model's float32 logits, as stored.
    ref_dir = Path(args.reference_dir)
    stage = json.loads((ref_dir.parent / STAGE_FILE).read_text())
    record = ReferenceRecord.model_validate(stage["result"])
    reference = stored_reference(StageOutput(stage["node"], stage["key"], ref_dir.parent, record, [], {}))
    # The token windows the build's reference scored (pipeline.stages.reference.IDS_FILE).
    text = json.loads((Path(args.reference_dir) / "eval_text.json").read_text())
    windows = text["windows"][: 2 if args.quick else 8]
    kernels: Kernels = "native" if args.device.startswith("cuda") else "emulated"
    out: dict[str, Any] = {}
    for scheme in KERNEL_SCHEMES:
        if scheme not in bundles:
            out[scheme] = {"status": "skipped", "reason": "not built"}
            continue
        try:
            out[scheme] = {
                "status": "ok",
                **check_kernels(bundles[scheme], windows, args.device, reference, kernels).as_dict(),
            }
        except KernelUnavailable as e:
            out[scheme] = {"status": "unsupported", "reason": e.message}
        except Exception as e:
            out[scheme] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    return out


def step_gptq_layer(args: argparse.Namespace) -> dict[str, Any]:
    """GPTQ of one decoder layer of the given shape with random weights, on the device, timed."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from kiln.formats.hf_model import open_source
    from kiln.quant.calibrated import calibrate
    from kiln.quant.catalog import get_scheme

    shape = (
        {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4}
        if args.quick
        else {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
    )
    work = Path(args.work)
    model_dir = work / "layer-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=4096, num_hidden_layers=1, max_position_embeddings=1024, tie_word_embeddings=False, **shape
    )
    config.architectures = ["LlamaForCausalLM"]
    started = time.time()
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    config.save_pretrained(model_dir)
    for f in (EXAMPLE / "model").iterdir():  # the example's tokenizer (vocab 4096): a source needs one
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copyfile(f, model_dir / f.name)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(model_dir / "model.safetensors"))
    del model
    made = time.time() - started
    samples_n, seq_len = (4, 64) if args.quick else (4, 128)
    g = torch.Generator().manual_seed(1)
    samples = torch.randint(0, 4096, (samples_n, seq_len), generator=g).tolist()
    source = open_source(model_dir)
    device = args.device if ":" in args.device or args.device == "cpu" else f"{args.device}:0"
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    calibrated = calibrate(
        source, get_scheme("w4a16-gptq"), samples, offload_dir=work, compute_dtype="bfloat16", device=device
    )
    seconds = time.time() - started
    linears = len(calibrated.scales)
    out = {
        "shape": shape,
        "layer_params": sum(t.numel for n, t in source.tensors.items() if ".layers.0." in n),
        "calibration_tokens": samples_n * seq_len,
        "device": device,
        "linears": linears,
        "make_model_s": round(made, 1),
        "gptq_s": round(seconds, 2),
    }
    if device.startswith("cuda"):
        out["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return out


def step_scale(args: argparse.Namespace) -> dict[str, Any]:
    """bench/scale.py at `--scale` on the device, in a child process given `--budget` seconds; its table and
    record, or, cut short, what each stage it finished recorded in its provenance."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    record = work / "scale.jsonl"
    free = shutil.disk_usage(work).free
    targets = next(t for t, needs in SCALE_TARGETS if free >= needs or args.scale != "8b")
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--sizes", args.scale, "--targets", targets]
    cmd += ["--device", args.device, "--work", str(work / "scale"), "--record", str(record), "--keep"]
    if (WHEELHOUSE / TOKENIZER).is_dir():  # trained here: the GPU machine's standard library is too small
        cmd += ["--tokenizer", str(WHEELHOUSE / TOKENIZER)]
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "disk_free_bytes": free}
    with open(work / "scale.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=args.budget)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            stdout, _ = proc.communicate()
            out["status"] = "failed"
            out["reason"] = f"cut short after {args.budget:.0f} s"
    out["returncode"] = proc.returncode
    out["table"] = stdout[-8000:]
    out["log_tail"] = (work / "scale.log").read_text(errors="replace")[-3000:]
    if proc.returncode != 0 and "status" not in out:
        out["status"] = "failed"
    if record.is_file():
        out["record"] = json.loads(record.read_text().splitlines()[-1])
    else:  # each finished stage's own record of what it used
        stages = []
        for meta in sorted((work / "scale").glob("*/work/*/*/stage.json"), key=lambda p: p.stat().st_mtime):
            data = json.loads(meta.read_text())
            used = data["provenance"].get("resources") or {}
            stages.append(
                {
                    "node": data["node"],
                    "device": (data["provenance"].get("device") or {}).get("name"),
                    **{k: used.get(k) for k in ("wall_s", "peak_rss_bytes", "peak_anon_bytes", "device_peak_bytes")},
                }
            )
        out["finished_stages"] = stages
    shutil.rmtree(work / "scale", ignore_errors=True)
    return out


STEPS = {
    "info": step_info,
    "probe": step_probe,
    "build": step_build,
    "kernels": step_kernels,
    "gptq-layer": step_gptq_layer,
    "scale": step_scale,
}


# --- the orchestrator ----------------------------------------------------------------------------------------


class Runner:
    """Starts steps as child processes with timeouts inside the overall budget, and keeps the record."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.deadline = time.time() + args.budget
        self.record: dict[str, Any] = run_record(
            benchmark="gpu_check", device=args.device, quick=args.quick, steps={}, setup=_setup_info()
        )

    def start(
        self, name: str, kind: str, *extra: str, device: str | None = None
    ) -> tuple[subprocess.Popen[str], Path, float, str]:
        out = self.tmp / f"{name}.json"
        log = self.tmp / f"{name}.log"
        most = max(STEP_LIMITS[kind], 0.8 * self.args.budget) if kind in ("build", "scale") else STEP_LIMITS[kind]
        limit = max(5.0, min(most, self.deadline - time.time() - 5))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--step", kind, "--step-out", str(out)]
        cmd += ["--device", device or self.args.device, *(["--quick"] if self.args.quick else []), *extra]
        print(f"[{time.strftime('%H:%M:%S')}] {name}: started (limit {limit:.0f} s)", flush=True)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return proc, out, time.time() + limit, name

    def finish(self, started: tuple[subprocess.Popen[str], Path, float, str]) -> dict[str, Any]:
        proc, out, until, name = started
        t0 = time.time()
        try:
            proc.wait(timeout=max(1.0, until - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
        log = (self.tmp / f"{name}.log").read_text(errors="replace")
        if out.is_file():
            result = json.loads(out.read_text())
        elif proc.returncode == -9:
            result = {"status": "failed", "reason": "timed out (killed)", "log_tail": log[-3000:]}
        else:
            result = {"status": "failed", "reason": f"exit code {proc.returncode}", "log_tail": log[-3000:]}
        result.setdefault("wall_s", round(time.time() - t0, 1))
        self.record["steps"][name] = result
        self.save()
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {result.get('status', 'ok')}", flush=True)
        return result

    def skip(self, name: str, reason: str) -> None:
        self.record["steps"][name] = {"status": "skipped", "reason": reason}
        self.save()
        print(f"[{time.strftime('%H:%M:%S')}] {name}: skipped ({reason})", flush=True)

    def save(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.jsonl").write_text(json.dumps(self.record, default=str) + "\n")


def _setup_info() -> Any:
    raw = os.environ.get(SETUP_ENV)
    return json.loads(raw) if raw else None


def _run_step(args: argparse.Namespace) -> None:
    """In a child: run one step and write its result (or its failure) as JSON."""
    started = time.time()
    try:
        result = {"status": "ok", **STEPS[args.step](args)}
    except Exception as e:
        import traceback

        result = {"status": "failed", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds_total"] = round(time.time() - started, 1)
    Path(args.step_out).write_text(json.dumps(result, default=str))


def compare_references(cpu_dir: str, cuda_dir: str) -> dict[str, Any]:
    """The CUDA reference against the CPU's, as each stored it (`eval.reference_rows`: one entry per window
    and per greedy prompt, named by the source and the token ids, so the two stores name them alike):
    KL between the windows' distributions where both stored whole logits, else top-1 agreement and the
    largest difference in log p(target); and how many greedy continuations are the same."""
    import numpy as np

    from kiln.eval.metrics import MetricAccumulator
    from kiln.eval.reference_rows import ReferenceRows

    acc = MetricAccumulator()
    worst, windows, rows, top1, dense = 0.0, 0, 0, 0, True
    for f in sorted(Path(cpu_dir).glob("*.npz")):
        other = Path(cuda_dir) / f.name
        if not other.is_file():
            continue
        a, b = ReferenceRows.from_bytes(f.read_bytes()), ReferenceRows.from_bytes(other.read_bytes())
        worst = max(worst, float(np.abs(a.target_logp - b.target_logp).max()))
        rows += a.rows
        top1 += int((a.argmax == b.argmax).sum())
        if a.dense is not None and b.dense is not None:
            acc.add(a.dense, b.dense, a.argmax)
        else:
            dense = False
        windows += 1
    greedy = same = 0
    for f in sorted(Path(cpu_dir).glob("*.json")):
        other = Path(cuda_dir) / f.name
        if other.is_file():
            greedy += 1
            same += int(json.loads(f.read_text()) == json.loads(other.read_text()))
    if windows == 0:
        return {"status": "failed", "reason": "no common reference windows"}
    out: dict[str, Any] = {
        "status": "ok",
        "windows": windows,
        "top1": top1 / rows,
        "max_abs_target_logp_diff": worst,
        "greedy_same": f"{same}/{greedy}",
    }
    if dense:
        out["kl"] = acc.result().kl
    return out


def _metrics(build: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    rows = {}
    for art in build.get("artifacts", []):
        for e in art["evals"]:
            rows[(art["artifact"], e["runtime"])] = {"status": e["status"], **(e["metrics"] or {})}
    return rows


def comparison(cuda: dict[str, Any], cpu: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per artifact and runtime: its metrics in the CUDA build and in the CPU build."""
    a, b = _metrics(cuda), _metrics(cpu)
    rows = []
    for key in sorted(set(a) | set(b)):
        ga, gb = a.get(key, {}), b.get(key, {})
        rows.append(
            {
                "artifact": key[0],
                "runtime": key[1],
                "status": f"{ga.get('status', '-')}/{gb.get('status', '-')}",
                **{f"{m}_{d}": g.get(m) for m in ("kl", "ppl_change", "top1") for d, g in (("cuda", ga), ("cpu", gb))},
            }
        )
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_tables(record: dict[str, Any]) -> None:
    steps = record["steps"]
    info = steps.get("info", {})
    print("\n== machine")
    for k in ("nvidia_smi", "gpu", "capability", "torch", "torch_cuda", "transformers", "jax", "jax_backend", "python"):
        if k in info:
            print(f"  {k}: {info[k]}")
    rows = record.get("comparison") or []
    if rows:
        print("\n== artifacts: CUDA build vs CPU build (KL and top-1 against each build's own reference)")
        head = f"{'artifact':<24}{'runtime':<14}{'status':<22}{'KL cuda':>10}{'KL cpu':>10}"
        print(head + f"{'ppl Δ cuda':>12}{'ppl Δ cpu':>11}{'top1 cuda':>10}{'top1 cpu':>9}")
        for r in rows:
            print(
                f"{r['artifact']:<24}{r['runtime']:<14}{r['status']:<22}{_fmt(r['kl_cuda'], '.2e'):>10}"
                f"{_fmt(r['kl_cpu'], '.2e'):>10}{_fmt(r['ppl_change_cuda'], '+.3%'):>12}"
                f"{_fmt(r['ppl_change_cpu'], '+.3%'):>11}{_fmt(r['top1_cuda'], '.4f'):>10}"
                f"{_fmt(r['top1_cpu'], '.4f'):>9}"
            )
    ref = steps.get("reference-cuda-vs-cpu")
    if ref:
        print(f"\n== reference on CUDA vs on the CPU: {json.dumps(ref)}")
    kernels = steps.get("kernels", {})
    if kernels:
        print("\n== W8A8 bundles: tensor-core kernels vs their float32 emulation (rest of the model float32 in both)")
        print(
            f"  {'scheme':<10} {'kernel':<62} {'out':<8} {'KL nat/ref':>10} {'KL emu/ref':>10} {'rel Δ':>8} "
            f"{'KL nat/emu':>10} {'top1 n/e':>8} {'max|Δ|':>7}"
        )
        for scheme in KERNEL_SCHEMES:
            k = kernels.get(scheme)
            if not isinstance(k, dict):
                continue
            if k.get("status") != "ok":
                print(f"  {scheme:<10} {k.get('status')}: {k.get('reason')}")
                continue
            print(
                f"  {scheme:<10} {k['kernel']:<62} {k['out_dtype']:<8} {k['kl_native_vs_reference']:>10.3e} "
                f"{k['kl_emulated_vs_reference']:>10.3e} {k['kl_relative_difference']:>+8.2%} "
                f"{k['kl_native_vs_emulated']:>10.2e} {k['top1_native_vs_emulated']:>8.4f} {k['max_abs_diff']:>7.3f}"
            )
    scale = steps.get("scale", {})
    if scale:
        print(f"\n== bench/scale.py on the device: {scale.get('command')} (exit {scale.get('returncode')})")
        print(scale.get("table") or scale.get("reason") or "")
        for row in scale.get("finished_stages", []):
            print(f"  {json.dumps(row)}")
        if scale.get("status") == "failed":
            print(scale.get("log_tail", ""))
    probe = steps.get("probe", {})
    if probe:
        print(f"\n== kiln hardware probe on the device: {probe.get('status', 'ok')}")
        print(probe.get("table") or probe.get("reason") or "")
    gptq = steps.get("gptq-layer", {})
    if gptq:
        print(f"\n== GPTQ of one layer: {json.dumps({k: v for k, v in gptq.items() if k != 'traceback'})}")
    print("\n== steps: " + ", ".join(f"{n}={s.get('status', 'ok')}" for n, s in steps.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="where gpu_check.jsonl goes")
    parser.add_argument("--device", default="cuda", help="cuda (the GPU run) or cpu (the CUDA-only parts skipped)")
    parser.add_argument("--quick", action="store_true", help="fewer artifacts and windows, a small GPTQ layer")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for everything after the setup")
    parser.add_argument("--record", action="store_true", help="also append the record to bench/results/")
    parser.add_argument("--scale", help="instead of the check: bench/scale.py at this size (1b, 8b) on the device")
    parser.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--step-out", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--bundles", help=argparse.SUPPRESS)
    parser.add_argument("--reference-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        _run_step(args)
        return
    setup(sys.argv[1:])
    cuda = args.device.startswith("cuda")
    tmp = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    runner = Runner(args, tmp)
    print(f"setup: {json.dumps(runner.record['setup'])}", flush=True)
    runner.finish(runner.start("info", "info"))
    gpu = bool(runner.record["steps"]["info"].get("cuda_available"))
    on_gpu = cuda and gpu
    if args.scale:
        runner.record["benchmark"] = "gpu_check --scale"
        runner.record["scale"] = args.scale
        if cuda and not gpu:
            runner.skip("scale", "no CUDA device visible")
        else:
            left = runner.deadline - time.time() - 30  # the step's own cut-off, before the runner's
            extra = ("--work", str(tmp / "scale"), "--scale", args.scale, "--budget", f"{left:.0f}")
            runner.finish(runner.start("scale", "scale", *extra))
        finish(runner, args, tmp)
        return
    if cuda and not gpu:
        runner.skip("probe", "no CUDA device visible")
    else:  # alone on the device, before the builds
        runner.finish(runner.start("probe", "probe"))
    # The two builds at once: the CUDA one on the GPU, the CPU one on the cores. The kernels and the GPTQ
    # layer run on the device after the device's build, while the CPU build finishes.
    if cuda and not gpu:
        runner.skip("build-cuda", "no CUDA device visible")
    elif not cuda:
        runner.skip("build-cuda", "--device cpu: CUDA-only")
    device_build = runner.start("build-cuda", "build", "--work", str(tmp / "cuda")) if on_gpu else None
    cpu_build: Any = runner.start("build-cpu", "build", "--work", str(tmp / "cpu"), device="cpu")
    if device_build is not None:
        built = runner.finish(device_build)
    else:
        built = runner.finish(cpu_build)
        cpu_build = None
    if built.get("status") == "ok" and built.get("bundles"):
        runner.finish(
            runner.start(
                "kernels",
                "kernels",
                "--bundles",
                json.dumps(built["bundles"]),
                "--reference-dir",
                str(built["reference_dir"]),
            )
        )
    else:
        runner.skip("kernels", "the build made no hf-bundle")
    if cuda and not gpu:
        runner.skip("gptq-layer", "no CUDA device visible")
    else:
        runner.finish(runner.start("gptq-layer", "gptq-layer", "--work", str(tmp / "gptq")))
    if cpu_build is not None:
        runner.finish(cpu_build)
    steps = runner.record["steps"]
    cu, cp = steps.get("build-cuda", {}), steps.get("build-cpu", {})
    ok = {name: b for name, b in (("cuda", cu), ("cpu", cp)) if b.get("status") == "ok"}
    if ok:  # both builds side by side, or the one that finished
        runner.record["comparison"] = comparison(ok.get("cuda", {}), ok.get("cpu", {}))
    if len(ok) == 2:
        try:
            steps["reference-cuda-vs-cpu"] = compare_references(cp["reference_dir"], cu["reference_dir"])
        except Exception as e:
            steps["reference-cuda-vs-cpu"] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    finish(runner, args, tmp)


def finish(runner: Runner, args: argparse.Namespace, tmp: Path) -> None:
    """The record saved (and appended to bench/results/ with --record), the tables printed, tmp removed."""
    runner.record["seconds"] = round(time.time() - runner.deadline + args.budget, 1)
    runner.save()
    print_tables(runner.record)
    if args.record:
        with open(RESULTS / "gpu_check.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(runner.record, default=str) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nrecord: {Path(args.out) / 'gpu_check.jsonl'}")


if __name__ == "__main__":
    main()
