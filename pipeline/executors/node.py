"""Running one node: what every executor does around a stage, wherever it runs.

`run_node` looks the node's output up in the store (a hit is `cached`), else runs the stage into a
temporary directory of the store with what its libraries print captured into `stage.log`, and
commits the output with its provenance, which records what the run used (`resources`, from
`core.usage`: wall and CPU time, its own peak RSS and anonymous memory, its child processes' peak, bytes
read and written); what a stage left behind in the process is released before the next one. A stage
that needs what this machine lacks raises `Deferred` (`deferred`); a failure leaves no output, keeps
the log under `<work>/logs/`, and raises a `KilnError` naming the stage and quoting the log's end. The
local executor calls it in its process; the Ray executor calls it in a Ray task on the node that has
the stage's resources; `kiln run-stage` calls it for one node.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from kiln.core.device import describe, host_memory_bytes
from kiln.core.errors import Deferred, KilnError, StageFailed
from kiln.core.usage import UsageMeter, left_behind, measure_usage, release_memory
from kiln.pipeline.placement import computes_on_device, stage_device
from kiln.pipeline.stage import (
    LOG_FILE,
    Node,
    StageContext,
    StageOutput,
    captured_output,
    log_tail,
    one_line,
    provenance,
    raised_at,
    write_traceback,
)
from kiln.pipeline.store import StageStore

# built: made now; cached: already in the store; ran: a stage with effects outside the store (publish);
# deferred: waits for a runner (or a node of a cluster) with what this one lacks; failed/cancelled:
# reported by executors that go on after a failure (Ray): the failure, and what waited on it.
Status = Literal["built", "cached", "ran", "deferred", "failed", "cancelled"]


@dataclass
class NodeOutcome:
    node: Node
    status: Status
    key: str | None = None
    output: StageOutput | None = None
    reason: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    error: KilnError | None = None  # a failed stage's error, as it raised it


class Reporter(Protocol):
    def start(self, node: Node, key: str) -> None: ...
    def progress(self, advance: int, total: int | None) -> None: ...
    def finish(self, outcome: NodeOutcome) -> None: ...


class SilentReporter:
    def start(self, node: Node, key: str) -> None:
        pass

    def progress(self, advance: int, total: int | None) -> None:
        pass

    def finish(self, outcome: NodeOutcome) -> None:
        pass


def _computing_threads(n: int) -> None:
    """torch computes with `n` threads, whatever the machine: reductions (calibration's Hessians, matmuls)
    give other last bits with another thread count, and a stage's output must not depend on where it
    ran (a local build and a Ray build give the same digests). `n` is the stage's `requires.cpus`."""
    import sys

    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:  # the registry-only install: no stage computes with torch
            return
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _host_memory_short(node: Node) -> tuple[str, dict[str, Any]] | None:
    """Why `node` cannot start here, if its planned host memory (`pipeline.requirements`, from the model's
    shape) exceeds what this machine has (`core.device.host_memory_bytes`): it is deferred to a runner or a
    Ray node that has it, never started to be killed halfway by the kernel's OOM killer."""
    need, have = node.requires.memory_bytes, host_memory_bytes()
    if have is None or need <= have:
        return None
    gib = 1024**3
    reason = (
        f"needs {need / gib:.1f} GiB of host memory (planned from the model's shape); "
        f"this machine has {have / gib:.1f} GiB"
    )
    return reason, {
        "runner": f"a machine with {math.ceil(need / gib)} GiB of memory",
        "memory_bytes": need,
        "host_memory_bytes": have,
    }


def _keep_failure_log(store: StageStore, node: Node, tmp: Path, error: BaseException) -> tuple[list[str], Path | None]:
    """A failed stage's log, its traceback appended, kept under `<work>/logs/` (the temporary directory is about to
    go); with what the stage's libraries printed last, before the traceback."""
    log = tmp / LOG_FILE
    tail = log_tail(log) if log.is_file() else []
    try:
        write_traceback(log, error)
    except OSError:  # the temporary directory is gone (a full disk, a stage that removed it): nothing to keep
        return tail, None
    return tail, store.keep_log(node, tmp)


def _unexpected(node: Node, error: BaseException, log: Path | None, tail: list[str]) -> StageFailed:
    """STAGE_FAILED for an error that is not kiln's own: what failed and where, where its traceback is, and what to
    try (the stage's hint, and running the stage alone)."""
    details: dict[str, object] = {"stage": node.id, "error": type(error).__name__, "raised_at": raised_at(error)}
    if log is not None:
        details.update(log=str(log), log_tail=tail)
    traceback_in = f"; its traceback is in {log}" if log is not None else ""
    hint = node.stage.hint(node) + "; " if node.stage.hint is not None else ""
    message = (
        f"{node.id} failed: {one_line(error)} (raised in {details['raised_at']}){traceback_in}. "
        f"To try: {hint}`kiln run-stage RECIPE {node.id}` runs it alone"
    )
    return StageFailed(message, details=details)


def run_node(
    store: StageStore,
    node: Node,
    inputs: dict[str, StageOutput],
    reporter: Reporter | None = None,
    where: Callable[[], dict[str, Any]] | None = None,
) -> NodeOutcome:
    """Run `node` (its `inputs` by role) unless its output is in `store`. `where` adds what the executor
    knows about the machine (a Ray node id, an accelerator) to the output's provenance."""
    reporter = reporter or SilentReporter()
    key = node.cache_key({out.node_id: out.digest for out in inputs.values()})
    cached = store.lookup(node, key)
    if cached is not None:
        return NodeOutcome(node, "cached", key, cached)
    # Before anything is set up for it: what the stage needs of this machine (`Stage.lacks`: a GPU runner), and
    # the memory it was planned to hold.
    short = node.stage.lacks(node) or _host_memory_short(node)
    if short is not None:
        return NodeOutcome(node, "deferred", key, reason=short[0], details=short[1])
    # A compute stage's device, checked before anything runs (DEVICE_UNAVAILABLE: this machine, or the Ray
    # worker, lacks the GPU it was placed on), and described in its provenance.
    device = describe(stage_device(node)) if computes_on_device(node) else None
    reporter.start(node, key)
    if node.stage.cacheable:  # what publishes (effects outside the store, run every time) computes nothing
        _computing_threads(node.requires.cpus)
    started = time.time()
    tmp = store.new_temp(node.stage.name, key)
    ctx = StageContext(
        node=node, out_dir=tmp / "files", inputs=inputs, progress=reporter.progress, fetch_external=store.external
    )
    meter: UsageMeter | None = None
    try:
        with measure_usage() as meter, captured_output(tmp / LOG_FILE):
            result = node.stage.run(ctx)
        if (tmp / LOG_FILE).stat().st_size == 0:
            (tmp / LOG_FILE).unlink()  # nothing printed: no log
    except Deferred as e:
        store.discard(tmp)
        return NodeOutcome(node, "deferred", key, reason=e.message, details=e.details)
    except BaseException as e:
        tail, log = _keep_failure_log(store, node, tmp, e)
        store.discard(tmp)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        if isinstance(e, KilnError):  # kiln's own error says what failed; the log keeps how it got there
            e.details.setdefault("stage", node.id)
            if log is not None:
                e.details.update(log=str(log), log_tail=tail)
            raise
        raise _unexpected(node, e, log, tail) from e
    finally:
        # What the stage dropped goes back before the next one runs in this process (`core.usage`).
        if meter is not None and meter.usage is not None and left_behind(meter.usage):
            release_memory()
    prov = provenance(node, key, inputs, started)
    if meter.usage is not None:
        prov["resources"] = meter.usage.to_json()
    if device is not None:
        prov["device"] = device
    if where is not None:
        prov["executor"] = where()
    prov.update({k: v for k, v in ctx.notes.items() if k not in prov})
    if not node.stage.cacheable:
        store.discard(tmp)
        output = StageOutput(node.id, key, tmp, result, [], prov)
        return NodeOutcome(node, "ran", key, output, seconds=time.time() - started)
    output = store.commit(node, key, tmp, result, prov, hashed=ctx.hashed)
    return NodeOutcome(node, "built", key, output, seconds=time.time() - started)
