"""The CLI as CI uses it: JSON on stdout, stable exit codes, errors that name the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from targets.base import ExportRequest, get_target
from tests.model_factory import make_model


def kiln(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "model")


def test_inspect_safetensors_and_gguf(model_dir: Path, tmp_path: Path) -> None:
    out = kiln("inspect", str(model_dir / "model.safetensors"), "--json")
    info = json.loads(out.stdout)
    assert info["format"] == "safetensors"
    assert {"name": "model.norm.weight", "dtype": "BF16", "shape": [64], "nbytes": 128} in info["tensors"]

    from pipeline.ingest import open_source

    res = get_target("gguf").export(open_source(model_dir), ExportRequest(quant="q8_0", out_dir=tmp_path))
    info = json.loads(kiln("inspect", str(tmp_path / res.files[0]), "--json").stdout)
    assert info["format"] == "gguf"
    assert info["metadata"]["general.architecture"] == "llama"
    types = {t["name"]: t["dtype"] for t in info["tensors"]}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"


def test_inspect_refuses_other_files(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"\x80\x04pickle")
    out = kiln("inspect", str(tmp_path / "x.bin"))
    assert out.returncode == 2 and "INVALID_INPUT" in out.stderr


def test_bad_recipe_exits_2_naming_the_field(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "heldout.txt").write_text("def f(): pass\n")
    recipe = {
        "model": "m",
        "version": "1",
        "source": str(model_dir),
        "eval": {"text": "heldout.txt"},
        "targets": [{"target": "gguf", "quants": ["q2_k"]}],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    out = kiln("build", str(tmp_path / "kiln.yaml"), "--json", "--work-dir", str(tmp_path / "work"))
    assert out.returncode == 2
    error = json.loads(out.stdout)["error"]
    assert error["code"] == "RECIPE_INVALID"
    assert error["details"]["errors"][0]["field"] == "targets[0]"


def test_plan_lists_stages_with_keys_and_nothing_built(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "heldout.txt").write_text("def f(): pass\n" * 50)
    recipe = {
        "model": "m",
        "version": "1",
        "source": str(model_dir),
        "eval": {"text": "heldout.txt"},
        "targets": [{"target": "hf-bundle", "quants": ["bf16"]}],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    out = kiln("plan", str(tmp_path / "kiln.yaml"), "--json", "--work-dir", str(tmp_path / "work"))
    rows = json.loads(out.stdout)
    assert [r["node"] for r in rows] == [
        "ingest/source",
        "reference/source",
        "export/hf-bundle-bf16",
        "eval/hf-bundle-bf16",
    ]
    assert {r["state"] for r in rows} == {"to build"}
    assert len(rows[0]["key"]) == 64


def test_promote_needs_model_at_version(tmp_path: Path) -> None:
    out = kiln("promote", "tiny-llama", "--channel", "prod", "--registry", str(tmp_path / "reg"))
    assert out.returncode == 2 and "MODEL@VERSION" in out.stderr


def test_failed_gate_exits_3_and_says_which(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "heldout.txt").write_text((Path(__file__).parent / "model_factory.py").read_text())
    recipe = {
        "model": "m",
        "version": "1",
        "source": str(model_dir),
        "eval": {"text": "heldout.txt", "max_tokens": 256, "gates": {"f16": {"max_kl": 0.0}}},
        "targets": [{"target": "gguf", "quants": ["f16"]}],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    out = kiln("build", str(tmp_path / "kiln.yaml"), "--json", "--work-dir", str(tmp_path / "work"))
    assert out.returncode == 3, out.stderr
    assert json.loads(out.stdout)["failed_gates"] == ["gguf-f16"]


def test_usage_errors_exit_2_with_a_usage_line() -> None:
    out = kiln("build")
    assert out.returncode == 2
    assert "Missing argument" in out.stderr and "Traceback" not in out.stderr
    assert kiln("no-such-command").returncode == 2


def test_tokens_yank_and_audit_from_the_cli(tmp_path: Path) -> None:
    registry = str(tmp_path / "registry")
    made = kiln("token", "create", "ci", "--scopes", "publish,promote", "--models", "tiny*", "--registry", registry)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("kiln_") and "ci" in made.stderr
    listed = json.loads(kiln("token", "list", "--registry", registry, "--json").stdout)
    assert [(t["name"], t["scopes"], t["models"]) for t in listed] == [("ci", ["promote", "publish"], ["tiny*"])]
    assert secret not in json.dumps(listed)
    assert kiln("token", "create", "x", "--scopes", "root", "--registry", registry).returncode == 2
    assert kiln("token", "revoke", "1", "--reason", "rotated", "--registry", registry).returncode == 0
    assert kiln("token", "revoke", "99", "--registry", registry).returncode == 4
    missing = kiln("yank", "tiny@1.0", "--reason", "bad", "--registry", registry)
    assert missing.returncode == 4 and "not found" in missing.stderr
    events = json.loads(kiln("audit", "--registry", registry, "--json").stdout)
    assert [e["action"] for e in events] == ["token.revoke", "token.create"]
    assert events[0]["reason"] == "rotated" and events[0]["actor"] == "local"
