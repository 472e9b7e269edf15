"""llama.cpp's own HF -> GGUF converter, as the pinned llama-cpp-python's sdist vendors it: the peer kiln's GGUF
writer is checked against (tests/targets/test_gguf_families.py) and timed against (bench/gguf_convert.py).

`vendored_llama_cpp` finds or unpacks `convert_hf_to_gguf.py`, its `conversion/` package and `gguf-py` from the
sdist of the installed llama-cpp-python version (`pip download`, which uses
pip's cache). `convert` runs the converter on several models in one process (its imports take most of its time).
The converter recognises tokenizers by a hash table and refuses the test models', so its vocabulary step is
skipped (`set_vocab` does nothing): its files hold no tokenizer.* keys.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

# Where the unpacked converter is kept between runs (`KILN_CONVERTER_CACHE` overrides it).
DEFAULT_CACHE = Path.home() / ".cache" / "kiln" / "converters"

# Runs the converter as its own __main__ once per job ([model dir, out file, outtype]), with the vocabulary step of
# the model class it picks skipped; writes {out file: "ok" or the error} to the results file.
DRIVER = """
import json, runpy, sys, traceback
vendored, jobs, results_file = sys.argv[1:4]
sys.path.insert(0, vendored)
import conversion
found = conversion.get_model_class
def without_vocab(*args, **kwargs):
    cls = found(*args, **kwargs)
    cls.set_vocab = lambda self: None
    return cls
conversion.get_model_class = without_vocab
script = vendored + "/convert_hf_to_gguf.py"
results = {}
for model, outfile, outtype in json.loads(jobs):
    sys.argv[:] = [script, model, "--outfile", outfile, "--outtype", outtype]
    try:
        runpy.run_path(script, run_name="__main__")
        results[outfile] = "ok"
    except BaseException as e:
        results[outfile] = "".join(traceback.format_exception_only(e)).strip() or type(e).__name__
with open(results_file, "w") as f:
    json.dump(results, f)
"""


def vendored_llama_cpp(cache: Path | None = None) -> Path:
    """The vendored llama.cpp directory (holding `convert_hf_to_gguf.py`) of the installed llama-cpp-python's sdist,
    unpacked once under `cache`. Raises `RuntimeError` saying why when the sdist cannot be had."""
    version = importlib.metadata.version("llama_cpp_python")
    cache = cache or Path(os.environ.get("KILN_CONVERTER_CACHE") or DEFAULT_CACHE)
    root = cache / f"llama-cpp-python-{version}"
    vendored = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (vendored / "convert_hf_to_gguf.py").is_file():
        return vendored
    root.mkdir(parents=True, exist_ok=True)
    sdist_name = f"llama_cpp_python-{version}.tar.gz"
    sdist = root / sdist_name if (root / sdist_name).is_file() else None
    if sdist is None:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(root)]
        proc = subprocess.run([*cmd, f"llama-cpp-python=={version}"], capture_output=True, text=True)
        sdist = root / sdist_name
        if proc.returncode != 0 or not sdist.is_file():
            raise RuntimeError(f"pip could not download the llama-cpp-python {version} sdist: {proc.stderr[-500:]}")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    wanted = (prefix + "convert_hf_to_gguf.py", prefix + "conversion/", prefix + "gguf-py/")
    with tarfile.open(sdist) as tar:
        tar.extractall(root, members=[m for m in tar.getmembers() if m.name.startswith(wanted)], filter="data")
    if not (vendored / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    (root / sdist_name).unlink(missing_ok=True)  # the three folders are all that is used
    return vendored


def convert(vendored: Path, jobs: list[tuple[Path, Path, str]], results: Path) -> dict[str, str]:
    """Run the converter on each (model dir, out file, outtype) in one process; {out file: "ok" or its error}."""
    payload = json.dumps([[str(m), str(o), t] for m, o, t in jobs])
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(vendored), payload, str(results)], capture_output=True, text=True
    )
    if proc.returncode != 0 or not results.is_file():
        raise RuntimeError(f"llama.cpp's converter exited {proc.returncode}: {proc.stderr[-2000:]}")
    out: dict[str, str] = json.loads(results.read_text())
    return out


# Metadata the converter derives from the model directory's name, which a comparison leaves out.
NAMING = ("general.name", "general.size_label", "general.basename", "general.finetune")


def gguf_tensors(path: Path) -> dict[str, Any]:
    """A GGUF file's tensors by name (gguf-py's reader)."""
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def gguf_fields(path: Path) -> dict[str, tuple[Any, str]]:
    """A GGUF file's metadata as {key: (value, its GGUF type)}, without the header's, the tokenizer's (the converter
    skips the test models' vocabularies) and the naming keys."""
    import gguf

    out = {}
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key in NAMING:
            continue
        out[key] = (field.contents(), field.types[0].name)
    return out
