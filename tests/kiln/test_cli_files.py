"""Every command that reads a file, fed hostile files: a coded error and exit 2, never a traceback.

The commands and their file parameters come from the CLI's own parser, so a new command (or a new file
option) is fed these files without a change here; a path kiln writes, or a directory it walks, is named in
`WRITTEN_OR_WALKED`. Commands run in this process (`kiln.cli.main`), against a registry that refuses
connections: a file must be refused before the registry is asked anything.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import typer

from kiln import cli

# (command, parameter): paths kiln writes to, or directories it walks, not files it reads.
WRITTEN_OR_WALKED = {
    ("routing render", "out"),  # fed a directory and a FIFO in test_an_output_that_cannot_be_written_is_refused
    ("keys generate", "path"),
    ("modelcar-base", "layout"),
    ("verify", "keep"),  # --download-to
    ("lint", "artifacts"),  # directories (or .gguf files): read by `inspect`'s reader, fed below as `inspect`
}
# Values for the other required parameters, by name; any other takes "x".
SAMPLE = {"ref": "tiny@1.0", "model": "tiny", "channel": "prod", "weights": "1.0=100", "hardware": "cpu"}
HOSTILE: dict[str, bytes | None] = {
    "invalid-utf8": b"name: \xff\xfe\x00\xc3(",
    "deep-yaml": b"[" * 100_000 + b"]" * 100_000,
    "deep-json": b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
    "huge-int": b"a: " + b"9" * 5000 + b"\n",
    "inf": b"a: .inf\nb: -.inf\n",
    "nan": b'{"a": NaN}',
    "date": b"measured_on: 2026-02-30\n",
    "control": b'device_name: "evil\\x1b[2J\\x07"\nname: "\\x00"\n',
    "empty": b"",
    "directory": None,
    "fifo": None,
}


READABLE = {"control", "date", "nan"}  # as YAML, a mapping of strings: for the registry to judge


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), command


def file_parameters() -> list[tuple[str, Any, Any]]:
    """(command, its click command, the parameter) for every Path parameter kiln reads a file from."""
    found = []
    for name, command in _commands(typer.main.get_command(cli.app)):
        for param in command.params:
            if "Path" in str(param.bare_type()) and (name, param.name) not in WRITTEN_OR_WALKED:
                found.append((name, command, param))
    return found


FILE_PARAMETERS = file_parameters()


def argv(name: str, command: Any, param: Any, path: Path) -> list[str]:
    """The command line of `name` with `path` for `param` and samples for its other required parameters."""
    args = name.split()
    for p in command.params:
        value = str(path) if p is param else (SAMPLE.get(p.name, "x") if p.required else None)
        if value is None:
            continue
        args += [value] if p.param_type_name == "argument" else [p.opts[0], value]
    return args


def hostile_file(tmp_path: Path, case: str) -> Path:
    path = tmp_path / f"hostile-{case}.yaml"
    if case == "directory":
        (path / "stage.json").mkdir(parents=True)
    elif case == "fifo":
        os.mkfifo(path)
    else:
        content = HOSTILE[case]
        assert content is not None
        path.write_bytes(content)
    return path


class Waited(BaseException):
    """A command blocked on its file (a FIFO opened for reading): not an error any command catches, so the test
    fails instead of passing on a coded error made from the interruption."""


def _timeout(signum: int, frame: FrameType | None) -> None:
    raise Waited("the command waited on its file")


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["kiln", *args])
    environment = dict(os.environ)  # a command sets variables for its stages (`publish`: KILN_SIGNING_KEY)
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(20)
    try:
        cli.main()
        code: Any = 0
    except SystemExit as e:
        code = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.environ.clear()  # none of them outlives the command in this process (a later test's publish read one)
        os.environ.update(environment)
    return int(code or 0), capsys.readouterr().err


@pytest.fixture(autouse=True)
def unreachable_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KILN_REGISTRY", "http://127.0.0.1:9")
    monkeypatch.setenv("KILN_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.delenv("KILN_VERIFY_KEY", raising=False)


def test_the_commands_that_read_files_are_found() -> None:
    found = {(name, p.name) for name, _, p in FILE_PARAMETERS}
    assert {("build", "recipe"), ("hardware set", "entry"), ("hardware probe", "saved"), ("performance", "record")} <= (
        found
    )


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize(
    ("name", "command", "param"), FILE_PARAMETERS, ids=[f"{n}:{p.name}" for n, _, p in FILE_PARAMETERS]
)
def test_a_hostile_file_is_a_coded_error(
    name: str,
    command: Any,
    param: Any,
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = run(monkeypatch, capsys, argv(name, command, param, hostile_file(tmp_path, case)))
    assert "Traceback" not in err
    assert "error [" in err, err  # a coded error, not a usage line
    # Exit 2, or (a mapping of JSON values, for the registry to judge) the registry that cannot be reached.
    assert code == 2 or (code == 7 and "[UNAVAILABLE]" in err and case in READABLE), err


@pytest.mark.parametrize("case", ["directory", "fifo"])
def test_an_output_that_cannot_be_written_is_refused(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = hostile_file(tmp_path, case)
    code, err = run(monkeypatch, capsys, ["routing", "render", "tiny", "--format", "kserve", "--out", str(out)])
    assert code == 2 and "OUTPUT_PATH_INVALID" in err and "Traceback" not in err


@pytest.mark.parametrize("catalog", ["missing.yaml", "bad.yaml", "."])
def test_a_bad_hardware_catalog_in_the_environment_is_a_coded_error(tmp_path: Path, catalog: str) -> None:
    """The commands load the hardware catalog as they are imported: a bad KILN_HARDWARE_CATALOG is reported as
    any kiln error is (exit 2, its code, no traceback), whatever the command."""
    import subprocess

    (tmp_path / "bad.yaml").write_text("hardware: [1, .nan\n")
    env = {**os.environ, "KILN_HARDWARE_CATALOG": str(tmp_path / catalog)}
    done = subprocess.run(
        [sys.executable, "-c", "from kiln.cli import main; main()", "plan", "examples/tiny-llama"],
        capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "[DATA_FILE_INVALID]" in done.stderr and "Traceback" not in done.stderr, done.stderr
