#!/usr/bin/env bash
# The wheels `bench/gpu_check.py` installs on a bare, offline GPU machine, downloaded here into .wheelhouse/gpu/
# (ignored by git; carry it with the working tree):
#
#   bash bench/gpu_wheels.sh            # after `make install`; prints the wheel set's size
#
# Which: every distribution that kiln's `build` extra pulls in, and those of the base install that a build
# imports (the CLI, pydantic, model signing; not the registry's server: fastapi, uvicorn, sqlalchemy), with
# their dependencies, read from this checkout's .venv with the exact versions installed there, less what the
# GPU machine brings with its torch and JAX builds (torch, transformers, jax, jaxlib and their CUDA plugins,
# nvidia-*, triton), less the large binary wheels its image is documented to hold already (PRESENT below,
# its package list as read on 2026-11-17: pyarrow, pandas, numpy, scipy, ...) and less the `s3` extra.
# Pure-python wheels are downloaded once; binary ones for CPython $PYTHONS (default 3.12, the GPU image's
# python3; 3.11, this checkout's, so the set can be tried here; 3.13 while the set stays under $MAX_MIB),
# manylinux x86_64. llama-cpp-python is left out: .wheelhouse's wheel is built for this machine's Python,
# so the GPU check builds no GGUF unless llama.cpp imports there. gpu_check.py installs only those the
# machine lacks (.wheelhouse/gpu/requirements.txt lists them all). Beside them, bench/scale.py's tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.wheelhouse/gpu}
PYTHONS=${PYTHONS:-"3.12 3.11 3.13"}
MAX_MIB=${MAX_MIB:-55}
test -x "$PY" || { echo "no $PY: run make install first" >&2; exit 2; }
rm -rf "$DEST"
mkdir -p "$DEST"
DEST="$DEST" PYTHONS="$PYTHONS" MAX_MIB="$MAX_MIB" "$PY" - <<'EOF'
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

dest = Path(os.environ["DEST"])
pythons = os.environ["PYTHONS"].split()
max_bytes = int(os.environ["MAX_MIB"]) * 2**20


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# What the GPU machine's torch / JAX builds bring (and must not be replaced): never carried.
GPU_OWN = re.compile(r"^(torch|transformers|jax|jaxlib|jax-cuda.*|nvidia-.*|triton|llama-cpp-python|cuda-.*)$")
# Large binary distributions the GPU image holds (its package list, 2026-11-17): not carried.
PRESENT = {
    "numpy", "pyarrow", "pandas", "scipy", "sympy", "networkx", "ml-dtypes", "tensorstore", "grpcio", "pillow",
    "hf-xet", "tokenizers", "safetensors", "psutil", "uvloop", "aiohttp", "yarl", "multidict", "frozenlist",
    "propcache", "regex", "pyyaml", "msgpack", "protobuf", "xxhash", "sentencepiece", "tiktoken", "opt-einsum",
    "markupsafe", "charset-normalizer", "h5py", "numba", "llvmlite", "scikit-learn", "opencv-python-headless",
}

kiln = md.distribution("kiln")
roots = [Requirement(r) for r in kiln.requires or []]
# The base install's distributions that a build imports (what gpu_check.py runs: the build, the calibration,
# the native-kernel check), asked of a fresh interpreter.
probe = (
    "import sys, json, importlib.metadata as md; import kiln.cli.build, pipeline.build, pipeline.executors.local, "
    "eval.native_kernels, quant.calibrated; by = md.packages_distributions(); "
    "print(json.dumps(sorted({d for m in list(sys.modules) for d in by.get(m.partition('.')[0], [])})))"
)
loaded = {norm(d) for d in __import__("json").loads(
    subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
)}
wanted = [r for r in roots if (r.marker is not None and r.marker.evaluate({"extra": "build"})) or norm(r.name) in loaded]
seen: dict[str, str] = {}
todo = [(r, "") for r in wanted]
while todo:
    req, extra = todo.pop()
    name = norm(req.name)
    if name in seen or GPU_OWN.match(name):
        continue
    try:
        dist = md.distribution(req.name)
    except md.PackageNotFoundError:
        continue  # a marker-only dependency this platform does not install
    seen[name] = dist.version
    for sub in dist.requires or []:
        r = Requirement(sub)
        extras = req.extras or {""}
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras):
            todo.append((r, ""))
# The `s3` extra (boto3: 16 MB of botocore): the check builds into a local store, and securesystemslib, which
# imports boto3 when it is there, does without it.
S3 = {"boto3", "botocore", "s3transfer", "jmespath"}
carried = {n: v for n, v in sorted(seen.items()) if n not in PRESENT | S3}
(dest / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in carried.items()))


def pure(name: str) -> bool:
    wheel = md.distribution(name).read_text("WHEEL") or ""
    return "Root-Is-Purelib: true" in wheel


pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
plat = ["--implementation", "cp", "--only-binary=:all:"]
for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
            "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64"):
    plat += ["--platform", tag]
pures = [f"{n}=={v}" for n, v in carried.items() if pure(n)]
binaries = [f"{n}=={v}" for n, v in carried.items() if not pure(n)]
subprocess.run([*pip, "--prefer-binary", *pures], check=True)
for i, py in enumerate(pythons):
    before = sum(f.stat().st_size for f in dest.glob("*.whl"))
    ok = subprocess.run([*pip, *plat, "--python-version", py, *binaries])
    total = sum(f.stat().st_size for f in dest.glob("*.whl"))
    if ok.returncode != 0:
        print(f"binary wheels for cp{py.replace('.', '')}: some not found (see above)", file=sys.stderr)
    if total > max_bytes and i > 0:  # past the budget: drop this Python's wheels again
        for f in dest.glob(f"*-cp{py.replace('.', '')}-*.whl"):
            f.unlink()
        print(f"cp{py.replace('.', '')}: left out ({total / 2**20:.1f} MiB > {max_bytes / 2**20:.0f} MiB)")
        break
print(f"{len(carried)} distributions ({len(pures)} pure, {len(binaries)} binary: {', '.join(binaries)})")
EOF
# bench/scale.py's 128,256-token tokenizer for `gpu_check.py --scale` (9 MB): the GPU image's standard library
# is too small to train it there.
"$PY" -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from scale import make_tokenizer; make_tokenizer(Path(sys.argv[1]) / 'tokenizer-128256')" "$DEST"
echo "wheel set: $(du -sh "$DEST" | cut -f1) in $(ls "$DEST"/*.whl | wc -l) wheels ($(du -sb "$DEST" | cut -f1) bytes)"
