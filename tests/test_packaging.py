"""The registry and CLI install without the build extras: importing them loads no torch or numpy."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "numpy", "transformers", "llama_cpp", "safetensors", "gguf")


def test_registry_server_and_cli_import_without_build_dependencies() -> None:
    code = (
        "import sys\n"
        "import kiln.cli, registry.app, registry.server, client, eval.report\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "kiln", "--help"], capture_output=True, text=True, check=True)
    for command in ("build", "plan", "publish", "promote", "resolve", "serve", "db", "inspect"):
        assert command in out.stdout
