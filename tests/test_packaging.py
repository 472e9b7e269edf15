"""The package: one name in site-packages (`kiln`, every package inside it), and the registry and CLI import
without the build extras (no torch or numpy)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

HEAVY = ("torch", "numpy", "transformers", "llama_cpp", "safetensors", "gguf")
ROOT = Path(__file__).resolve().parents[1]
# The repository's package folders, each kiln.<name> once installed: the links in kiln/ name them.
PACKAGES = sorted(p.name for p in (ROOT / "kiln").iterdir() if p.is_symlink())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    (built,) = out.glob("kiln-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_one_top_level_name(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"kiln"}
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["kiln"]
    # every package of the repository, whole: each module of its folder, and its data files
    assert len(PACKAGES) == 11, PACKAGES
    for package in PACKAGES:
        modules = {
            p.relative_to(ROOT).as_posix() for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts
        }
        assert modules and {f"kiln/{m}" for m in modules} <= set(names), package
    assert {"kiln/core/hardware.yaml", "kiln/registry/web/templates/base.html"} <= set(names)
    assert not [n for n in names if n.startswith("kiln/tests/") or n.startswith("tests/")]


def test_the_installed_wheel_imports_as_kiln(wheel: zipfile.ZipFile, tmp_path: Path) -> None:
    # Unpacked ahead of the checkout's editable install, every package is kiln.<name> from the wheel's files.
    site = tmp_path / "site"
    wheel.extractall(site)
    code = (
        "import kiln.cli, kiln.registry.app, kiln.pipeline.build, kiln.migrations\n"
        "print(kiln.registry.app.__file__, kiln.pipeline.build.__file__, kiln.migrations.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, check=True
    )
    files = out.stdout.split()
    assert len(files) == 3 and all(Path(f).is_relative_to(site / "kiln") for f in files), files


def test_registry_server_and_cli_import_without_build_dependencies() -> None:
    code = (
        "import sys\n"
        "import kiln.cli, kiln.registry.app, kiln.registry.server, kiln.client, kiln.eval.report\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "kiln", "--help"], capture_output=True, text=True, check=True)
    for command in ("build", "plan", "publish", "promote", "resolve", "serve", "db", "inspect"):
        assert command in out.stdout
