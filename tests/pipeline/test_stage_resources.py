"""Each stage's provenance records what its run used (`core.usage`), and none of it enters a cache key."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from pathlib import Path

from kiln.core.usage import release_memory
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.records import Record
from kiln.pipeline.stage import Node, Stage, StageContext
from kiln.pipeline.store import WorkDir
from tests.memory import MIB, new_pages


class Held(Record):
    mib: int


def _allocate(ctx: StageContext) -> Held:
    """Hold `mib` MiB for 0.2 s, write `write_mib` MiB, and run a child holding `child_mib` MiB."""
    mib = int(ctx.node.params["mib"])
    with new_pages(mib):
        time.sleep(0.2)
    (ctx.out_dir / "out.bin").write_bytes(bytes(int(ctx.node.params.get("write_mib", 0)) * MIB))
    if child := ctx.node.params.get("child_mib"):
        code = f"import time; b = bytearray({child} << 20); time.sleep(0.6)"
        subprocess.run([sys.executable, "-c", code], check=True)
    return Held(mib=mib)


ALLOCATE = Stage("allocate", "1", _allocate, Held)


class _Cycle:
    def __init__(self, mib: int) -> None:
        self.block = new_pages(mib)
        self.me = self  # only a full garbage collection frees it


def _leave_behind(ctx: StageContext) -> Held:
    """Drop `mib` MiB held by a reference cycle that has aged into the oldest generation, as a model held by
    its modules' hooks does after an eval: nothing frees it until a full collection."""
    mib = int(ctx.node.params["mib"])
    cycle = _Cycle(mib)
    gc.collect()
    gc.collect()  # survived twice: in the oldest generation now
    del cycle
    return Held(mib=mib)


LEAVE = Stage("leave", "1", _leave_behind, Held)


def test_a_stage_records_its_own_peak_its_childrens_and_its_bytes_written(tmp_path: Path) -> None:
    node = Node("allocate/a", ALLOCATE, params={"mib": 96, "write_mib": 24, "child_mib": 64})
    out = LocalExecutor(WorkDir(tmp_path)).run([node])["allocate/a"].output
    assert out is not None
    r = out.provenance["resources"]
    assert r["peak_rss_bytes"] >= 96 * MIB and r["peak_rss_bytes"] >= r["rss_start_bytes"]
    assert r["peak_anon_bytes"] - r["anon_start_bytes"] >= 96 * MIB * 0.95
    assert r["children_peak_rss_bytes"] >= 64 * MIB
    assert r["io"]["wchar"] >= 24 * MIB
    assert 0.8 <= r["wall_s"] <= out.provenance["duration_s"] + 0.01
    assert set(r) >= {"cpu_s", "peak_rss_exact", "children_io"}
    # What stage.json holds is what the output says.
    again = LocalExecutor(WorkDir(tmp_path)).run([node])["allocate/a"]
    assert again.status == "cached" and again.output is not None and again.output.provenance["resources"] == r


def test_what_a_run_used_is_not_in_the_key_or_the_digest(tmp_path: Path) -> None:
    """The same stage run twice uses other time and memory; its key and its output's digest do not move."""
    node = Node("allocate/a", ALLOCATE, params={"mib": 16})
    first = LocalExecutor(WorkDir(tmp_path / "one")).run([node])["allocate/a"]
    second = LocalExecutor(WorkDir(tmp_path / "two")).run([node])["allocate/a"]
    assert first.output is not None and second.output is not None
    assert "resources" in first.output.provenance and "resources" in second.output.provenance
    assert (first.key, first.output.digest) == (second.key, second.output.digest)


def test_what_a_stage_left_behind_is_released_before_the_next_stage(tmp_path: Path) -> None:
    nodes = [Node("leave/a", LEAVE, params={"mib": 384}), Node("allocate/b", ALLOCATE, params={"mib": 1})]
    # What earlier tests in this process left for the collector is returned first: freed during the stage,
    # it would hide part of what the stage left behind.
    release_memory()
    outcomes = LocalExecutor(WorkDir(tmp_path)).run(nodes)
    left = outcomes["leave/a"].output.provenance["resources"]  # type: ignore[union-attr]
    after = outcomes["allocate/b"].output.provenance["resources"]  # type: ignore[union-attr]
    assert left["anon_end_bytes"] - left["anon_start_bytes"] >= 384 * MIB * 0.95  # it did leave it behind
    assert after["anon_start_bytes"] < left["anon_end_bytes"] - 320 * MIB
