"""The content-addressed stage cache: keys, reuse, atomic commits, and recovery after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from kiln.core.error_codes import Codes
from kiln.core.errors import Deferred, KilnError, StageFailed
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.report import BuildSummary
from kiln.pipeline.stage import Node, Stage, StageContext
from kiln.pipeline.store import WorkDir

calls: list[str] = []


class Written(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int


class Nothing(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _write(ctx: StageContext) -> Written:
    calls.append(ctx.node.id)
    (ctx.out_dir / "out.txt").write_text(f"{ctx.node.params}")
    return Written(n=ctx.node.params.get("n", 0))


def _upper(ctx: StageContext) -> Nothing:
    calls.append(ctx.node.id)
    assert ctx.record("text", Written).n >= 0
    text = (ctx.input("text").files_dir / "out.txt").read_text()
    (ctx.out_dir / "upper.txt").write_text(text.upper())
    return Nothing()


WRITE = Stage("write", "1", _write, Written)
UPPER = Stage("upper", "1", _upper, Nothing)


def _graph(n: int = 1) -> list[Node]:
    a = Node("write/a", WRITE, params={"n": n})
    return [a, Node("upper/a", UPPER, params={}, inputs={"text": a.id})]


def test_second_run_reuses_every_stage(tmp_path: Path) -> None:
    calls.clear()
    first = LocalExecutor(WorkDir(tmp_path)).run(_graph())
    second = LocalExecutor(WorkDir(tmp_path)).run(_graph())
    assert [o.status for o in first.values()] == ["built", "built"]
    assert [o.status for o in second.values()] == ["cached", "cached"]
    assert calls == ["write/a", "upper/a"]
    assert (second["upper/a"].output.files_dir / "upper.txt").read_text() == "{'N': 1}"


def test_changed_params_change_the_key_and_invalidate_downstream(tmp_path: Path) -> None:
    first = LocalExecutor(WorkDir(tmp_path)).run(_graph(1))
    second = LocalExecutor(WorkDir(tmp_path)).run(_graph(2))
    assert first["write/a"].key != second["write/a"].key
    assert first["upper/a"].key != second["upper/a"].key
    assert second["upper/a"].status == "built"


def test_cache_key_is_hash_of_canonical_json_not_concatenation() -> None:
    # ("ab", "c") and ("a", "bc") must not collide the way joined strings would.
    n1 = Node("write/x", WRITE, params={"a": "ab", "b": "c"})
    n2 = Node("write/x", WRITE, params={"a": "a", "b": "bc"})
    assert n1.cache_key({}) != n2.cache_key({})
    assert n1.cache_key({}) == Node("write/y", WRITE, params={"b": "c", "a": "ab"}).cache_key({})


def test_cache_key_keeps_each_inputs_role() -> None:
    # The same two digests in swapped roles (reference vs candidate) are a different computation.
    digests = {"x/1": "1" * 64, "x/2": "2" * 64}
    one = Node("upper/a", UPPER, params={}, inputs={"reference": "x/1", "candidate": "x/2"})
    other = Node("upper/a", UPPER, params={}, inputs={"reference": "x/2", "candidate": "x/1"})
    assert one.cache_key(digests) != other.cache_key(digests)


def _mangled(meta: bytes, out: Path, how: str) -> bytes:
    """`meta` (a stage.json) spoiled as `how` says; some spoil the output's file instead."""
    m = json.loads(meta)
    if how == "truncated":
        return meta[: len(meta) // 2]
    if how == "empty":
        return b""
    if how == "garbage":
        return bytes(range(256)) * 4
    if how == "list":
        return json.dumps([m]).encode()
    if how == "no-result":
        return json.dumps({k: v for k, v in m.items() if k != "result"}).encode()
    if how == "files-not-a-list":
        return json.dumps({**m, "files": {"out.txt": m["files"][0]}}).encode()
    if how == "bad-record":
        return json.dumps({**m, "result": {"n": "one"}}).encode()
    if how == "nested":
        return json.dumps({**m, "provenance": "deep"}).encode().replace(b'"deep"', b"[" * 5000 + b"]" * 5000)
    if how == "other-sha256":
        return json.dumps({**m, "files": [{**m["files"][0], "sha256": "0" * 64}]}).encode()
    if how == "file-changed":
        (out / "files" / "out.txt").write_text("{'n': 9}")  # same size, other bytes
    if how == "file-missing":
        (out / "files" / "out.txt").unlink()
    return meta


SPOILED = [
    "truncated", "empty", "garbage", "list", "no-result", "files-not-a-list", "bad-record", "nested",
    "other-sha256", "file-changed", "file-missing",
]  # fmt: skip


@pytest.mark.parametrize("how", SPOILED)
def test_a_corrupt_output_in_the_work_dir_is_moved_aside_and_built_again(
    how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls.clear()
    first = LocalExecutor(WorkDir(tmp_path)).run(_graph())
    out = first["write/a"].output.path
    meta = out / "stage.json"
    meta.write_bytes(_mangled(meta.read_bytes(), out, how))
    with caplog.at_level("WARNING", logger="kiln.pipeline.stage"):
        again = LocalExecutor(WorkDir(tmp_path)).run(_graph())
    assert [o.status for o in again.values()] == ["built", "cached"]  # the same output, so upper/a is reused
    assert again["write/a"].output.digest == first["write/a"].output.digest
    assert (again["write/a"].output.files_dir / "out.txt").read_text() == "{'n': 1}"
    assert calls == ["write/a", "upper/a", "write/a"]
    (aside,) = (tmp_path / "corrupt").iterdir()  # kept to look at, out of the store
    assert aside.name.startswith("write-" + first["write/a"].key[:16])
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "write/a [STAGE_RECORD_CORRUPT]" in warning and str(out) in warning and str(aside) in warning
    assert LocalExecutor(WorkDir(tmp_path)).run(_graph())["write/a"].status == "cached"


@pytest.mark.parametrize("kind", ["directory", "fifo", "missing"])
def test_a_stage_json_that_is_not_a_regular_file_is_moved_aside_and_built_again(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls.clear()
    first = LocalExecutor(WorkDir(tmp_path)).run(_graph())["write/a"].output
    assert first is not None
    meta = first.path / "stage.json"
    meta.unlink()
    if kind == "directory":
        (meta / "inside").mkdir(parents=True)
    elif kind == "fifo":
        os.mkfifo(meta)  # never opened: a read would wait for a writer
    with caplog.at_level("WARNING", logger="kiln.pipeline.stage"):
        again = LocalExecutor(WorkDir(tmp_path)).run(_graph())
    rebuilt = again["write/a"].output
    assert [o.status for o in again.values()] == ["built", "cached"] and rebuilt is not None
    assert rebuilt.digest == first.digest
    (aside,) = (tmp_path / "corrupt").iterdir()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "write/a [STAGE_RECORD_CORRUPT]" in warning and str(meta) in warning


def test_a_corrupt_output_that_cannot_be_moved_aside_stops_with_its_code(tmp_path: Path) -> None:
    first = LocalExecutor(WorkDir(tmp_path)).run(_graph())
    (first["write/a"].output.path / "stage.json").write_text("{")
    (tmp_path / "corrupt").write_text("a file where the corrupt outputs go")
    with pytest.raises(KilnError) as e:
        LocalExecutor(WorkDir(tmp_path)).run(_graph())
    assert e.value.code == "STAGE_RECORD_CORRUPT" and str(first["write/a"].output.path) in e.value.message


def test_a_kept_output_is_read_again_only_after_it_changed(tmp_path: Path) -> None:
    """Cached lookups verify every file's sha256 through a stat-keyed cache: hashed when the stage sealed it."""
    first = LocalExecutor(WorkDir(tmp_path)).run(_graph())
    out = first["write/a"].output.files_dir / "out.txt"
    verified = json.loads((tmp_path / ".verified-files.json").read_text())
    assert verified[str(out.resolve())]["sha256"] == first["write/a"].output.files[0].sha256


def test_failed_stage_leaves_nothing_that_looks_done(tmp_path: Path) -> None:
    def boom(ctx: StageContext) -> Nothing:
        (ctx.out_dir / "half.bin").write_bytes(b"x" * 100)
        raise ValueError("disk on fire")

    node = Node("boom/a", Stage("boom", "1", boom, Nothing), params={})
    with pytest.raises(StageFailed, match="disk on fire"):
        LocalExecutor(WorkDir(tmp_path)).run([node])
    assert not any((tmp_path / "boom").iterdir())


def test_deferred_stage_defers_its_dependents(tmp_path: Path) -> None:
    def needs_gpu(ctx: StageContext) -> Written:
        raise Deferred("deferred to a runner with an H100")

    a = Node("gpu/a", Stage("gpu", "1", needs_gpu, Written), params={})
    b = Node("upper/a", UPPER, params={}, inputs={"text": a.id})
    out = LocalExecutor(WorkDir(tmp_path)).run([a, b])
    assert out["gpu/a"].status == "deferred" and "H100" in out["gpu/a"].reason
    assert out["upper/a"].status == "deferred" and "gpu/a" in out["upper/a"].reason


KILLED_STAGE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from pydantic import BaseModel
    from kiln.pipeline.executors.local import LocalExecutor
    from kiln.pipeline.stage import Node, Stage
    from kiln.pipeline.store import WorkDir

    class Done(BaseModel):
        pass

    def slow(ctx):
        (ctx.out_dir / "part.bin").write_bytes(b"half")
        if sys.argv[2] == "hang":
            (Path(sys.argv[1]) / "started").touch()  # what a stage prints goes to its log: a file says it
            time.sleep(60)
        (ctx.out_dir / "part.bin").write_bytes(b"whole")
        return Done()

    out = LocalExecutor(WorkDir(Path(sys.argv[1]))).run([Node("slow/a", Stage("slow", "1", slow, Done), params={})])
    print(out["slow/a"].status, flush=True)
    """
)


def test_stage_killed_midway_is_redone(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(KILLED_STAGE)
    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with subprocess.Popen(
        [sys.executable, str(script), str(work), "hang"], stdout=subprocess.PIPE, text=True, env=env
    ) as proc:
        for _ in range(600):
            if (work / "started").exists():
                break
            time.sleep(0.05)
        assert (work / "started").exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert [p.name for p in (work / "slow").iterdir()][0].startswith(".tmp-")  # half output, not a key dir

    done = subprocess.run([sys.executable, str(script), str(work), "finish"], capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "built", done.stderr
    (key_dir,) = list((work / "slow").iterdir())  # the stale temp dir was swept
    assert (key_dir / "files" / "part.bin").read_bytes() == b"whole"


def test_hash_cache_never_serves_a_stale_digest(tmp_path: Path) -> None:
    from kiln.core.digest import HashCache, sha256_file

    f = tmp_path / "weights.bin"
    f.write_bytes(b"a" * 1000)
    cache = HashCache(tmp_path / "cache.json")
    first = cache.sha256(f)
    cache.save()
    with open(f, "r+b") as fh:  # same size, rewritten in place
        fh.write(b"b")
    again = HashCache(tmp_path / "cache.json").sha256(f)
    assert again != first and again == sha256_file(f)


def test_what_a_stage_prints_goes_to_its_log_and_a_failure_quotes_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    def noisy(ctx: StageContext) -> Written:
        print("python logging, progress bars")
        os.write(2, b"a C library writing to its stderr\n")
        return Written(n=1)

    def failing(ctx: StageContext) -> Written:
        print("loading weights")
        os.write(2, b"the last thing it said\n")
        raise ValueError("boom")

    out = LocalExecutor(WorkDir(tmp_path)).run([Node("noisy/a", Stage("noisy", "1", noisy, Written), params={})])
    printed = capfd.readouterr()
    assert "progress bars" not in printed.out + printed.err and "C library" not in printed.out + printed.err
    log = (out["noisy/a"].output.path / "stage.log").read_text()
    assert "python logging, progress bars" in log and "a C library writing to its stderr" in log
    with pytest.raises(StageFailed) as failed:
        LocalExecutor(WorkDir(tmp_path)).run([Node("failing/a", Stage("failing", "1", failing, Written), params={})])
    assert "the last thing it said" not in capfd.readouterr().err
    assert failed.value.details["log_tail"] == ["loading weights", "the last thing it said"]
    printed_then_traceback = Path(failed.value.details["log"]).read_text().split("the last thing it said\n")[1]
    assert "Traceback (most recent call last)" in printed_then_traceback
    assert printed_then_traceback.endswith('raise ValueError("boom")\nValueError: boom\n')
    print("the terminal is back")
    assert capfd.readouterr().out == "the terminal is back\n"


def test_a_failure_names_what_failed_where_its_traceback_is_and_what_to_try(tmp_path: Path) -> None:
    """An error that is not kiln's own: STAGE_FAILED names the stage, the error on one line, the library frame that
    raised it and the stage's own call into it, the kept log (ending with the traceback), and what to try."""

    def parsing(ctx: StageContext) -> Written:
        json.loads('{"n": 1,\n')  # raises inside the json module, not in the stage
        return Written(n=1)

    stage = Stage("parse", "1", parsing, Written, hint=lambda node: f"give {node.id} valid JSON")
    with pytest.raises(StageFailed) as failed:
        LocalExecutor(WorkDir(tmp_path)).run([Node("parse/a", stage, params={})])
    e = failed.value
    where = e.details["raised_at"]
    assert e.details["error"] == "JSONDecodeError" and "json/decoder.py:" in where
    assert where.endswith("in parsing") and ", from tests/pipeline/test_stage_cache.py:" in where
    assert e.message == (
        f"parse/a failed: JSONDecodeError: Expecting property name enclosed in double quotes: line 2 column 1 "
        f"(char 9) (raised in {where}); its traceback is in {e.details['log']}. "
        "To try: give parse/a valid JSON; `kiln run-stage RECIPE parse/a` runs it alone"
    )
    log = Path(e.details["log"]).read_text()
    assert e.details["log_tail"] == [] and log.lstrip().startswith("Traceback (most recent call last)")
    assert "in parsing" in log and log.endswith("(char 9)\n")


def test_a_kiln_error_keeps_its_message_and_leaves_its_traceback_in_the_log(tmp_path: Path) -> None:
    def refusing(ctx: StageContext) -> Written:
        raise KilnError("the model is refused, and why", code=Codes.HARDWARE_INCOMPATIBLE)

    with pytest.raises(KilnError) as failed:
        LocalExecutor(WorkDir(tmp_path)).run([Node("refuse/a", Stage("refuse", "1", refusing, Written), params={})])
    assert failed.value.code == "HARDWARE_INCOMPATIBLE" and failed.value.message == "the model is refused, and why"
    assert failed.value.details["stage"] == "refuse/a"
    assert "in refusing" in Path(failed.value.details["log"]).read_text()


def small_recipe(root: Path) -> Path:
    """A recipe of one GGUF artifact of a small model, beside its model and held-out text."""
    from tests.model_factory import make_model

    make_model(root / "model")
    (root / "heldout.txt").write_text((Path(__file__).parents[1] / "model_factory.py").read_text())
    recipe = {
        "model": "m",
        "version": "1",
        "source": "model",
        "eval": {"text": "heldout.txt", "max_tokens": 256},
        "targets": [{"target": "gguf", "quants": ["f16"]}],
    }
    (root / "kiln.yaml").write_text(json.dumps(recipe))
    return root / "kiln.yaml"


def kiln_build(
    recipe: Path, work: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kiln", "build", str(recipe), "--json", "--work-dir", str(work), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def _without_seconds(artifacts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**a, "evals": [{k: v for k, v in e.items() if k != "seconds"} for e in a["evals"]]} for a in artifacts]


def test_kiln_build_builds_a_corrupt_stage_again_and_says_so(tmp_path: Path) -> None:
    recipe = small_recipe(tmp_path)
    first = kiln_build(recipe, tmp_path / "work")
    assert first.returncode == 0, first.stderr
    # `--json` prints the build's typed summary, and the report beside the work dir is the same record.
    summary = BuildSummary.model_validate_json(first.stdout)
    assert summary.stages == {"built": len(summary.stage_seconds)} and summary.seconds is not None
    assert [a.artifact for a in summary.artifacts] == ["gguf-f16"] and summary.artifacts[0].evals
    report = tmp_path / "reports" / f"{summary.model}-{summary.version}.json"
    assert BuildSummary.model_validate_json(report.read_text()) == summary
    (meta,) = (tmp_path / "work" / "export").glob("*/stage.json")
    meta.write_bytes(meta.read_bytes()[:40])  # truncated
    again = kiln_build(recipe, tmp_path / "work")
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stdout + again.stderr
    assert "export/gguf-f16 [STAGE_RECORD_CORRUPT]" in again.stderr and str(meta) in again.stderr
    # The same artifacts and metrics (the rebuilt export has the same digest, so its eval is reused).
    assert _without_seconds(json.loads(again.stdout)["artifacts"]) == _without_seconds(
        json.loads(first.stdout)["artifacts"]
    )
    assert json.loads(meta.read_text())["node"] == "export/gguf-f16"  # built again in its place
