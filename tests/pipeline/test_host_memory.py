"""A stage planned to need more host memory than this machine has is deferred, never started."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.device import host_memory_bytes
from kiln.core.errors import InvalidInput
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.records import Record
from kiln.pipeline.requirements import Requirements
from kiln.pipeline.stage import Node, Stage, StageContext
from kiln.pipeline.store import WorkDir

GiB = 1 << 30
RAN: list[str] = []


class Done(Record):
    ok: bool


def _run(ctx: StageContext) -> Done:
    RAN.append(ctx.node.id)
    return Done(ok=True)


STAGE = Stage("needs-memory", "1", _run, Done)


def _node(name: str, memory: int, **inputs: str) -> Node:
    return Node(name, STAGE, params={"n": name}, inputs=inputs, requires=Requirements(cpus=1, memory_bytes=memory))


def test_a_stage_needing_more_than_the_host_has_is_deferred_and_what_waits_on_it_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_HOST_MEMORY", str(8 * GiB))
    RAN.clear()
    small, big = _node("needs-memory/small", 2 * GiB), _node("needs-memory/big", 30 * GiB)
    after = _node("needs-memory/after", 1 * GiB, before="needs-memory/big")
    out = LocalExecutor(WorkDir(tmp_path)).run([small, big, after])
    assert out["needs-memory/small"].status == "built"
    assert out["needs-memory/big"].status == "deferred"
    assert "30.0 GiB of host memory" in out["needs-memory/big"].reason and "8.0 GiB" in out["needs-memory/big"].reason
    assert out["needs-memory/big"].details["memory_bytes"] == 30 * GiB
    assert out["needs-memory/after"].status == "deferred"
    assert RAN == ["needs-memory/small"]  # the big one never started


def test_the_host_memory_is_the_lowest_of_ram_cgroup_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_HOST_MEMORY", raising=False)
    whole = host_memory_bytes()
    assert whole is not None and whole > GiB
    monkeypatch.setenv("KILN_HOST_MEMORY", str(GiB))
    assert host_memory_bytes() == GiB
    monkeypatch.setenv("KILN_HOST_MEMORY", str(whole * 4))  # a setting above the machine's RAM changes nothing
    assert host_memory_bytes() == whole
    monkeypatch.setenv("KILN_HOST_MEMORY", "16GiB")
    with pytest.raises(InvalidInput) as e:
        host_memory_bytes()
    assert e.value.code == "INVALID_HOST_MEMORY"
