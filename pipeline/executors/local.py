"""The embedded executor: runs a stage graph on this machine, one stage at a time, reusing the cache.

What a stage's libraries print (transformers and llm-compressor logs, progress bars, llama.cpp's C
output, subprocesses) is captured at the file-descriptor level into the stage's `stage.log`, kept
beside its `stage.json`; the terminal shows kiln's own lines. When a stage fails, its log is kept
under `<work>/logs/` and the error names it and quotes its last lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from core.errors import Deferred, KilnError, StageFailed
from pipeline.stage import LOG_FILE, Node, StageContext, StageOutput, WorkDir, captured_output, log_tail, provenance

Status = Literal["built", "cached", "ran", "deferred"]


@dataclass
class NodeOutcome:
    node: Node
    status: Status
    key: str | None = None
    output: StageOutput | None = None
    reason: str = ""
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


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


class LocalExecutor:
    def __init__(self, workdir: WorkDir, reporter: Reporter | None = None):
        self.workdir = workdir
        self.reporter = reporter or SilentReporter()

    def run(self, nodes: list[Node]) -> dict[str, NodeOutcome]:
        """Run every node whose output is not cached; a failure stops the run and leaves no partial output."""
        self.workdir.sweep_stale()
        outcomes: dict[str, NodeOutcome] = {}
        for node in nodes:
            missing = [i for i in node.inputs.values() if i not in outcomes]
            if missing:
                raise KilnError(f"{node.id} runs before its inputs {missing}", code="GRAPH_ORDER")
            blocked = [i for i in node.inputs.values() if outcomes[i].status == "deferred"]
            if blocked:
                outcomes[node.id] = NodeOutcome(node, "deferred", reason=f"waits on {', '.join(blocked)}")
                self.reporter.finish(outcomes[node.id])
                continue
            inputs = {role: outcomes[i].output for role, i in node.inputs.items()}
            outcomes[node.id] = self._run_one(node, inputs)  # type: ignore[arg-type]  # none deferred: all have output
            self.reporter.finish(outcomes[node.id])
        return outcomes

    def _run_one(self, node: Node, inputs: dict[str, StageOutput]) -> NodeOutcome:
        """Run `node` (its `inputs` by role) unless its output is in the cache."""
        key = node.cache_key({out.node_id: out.digest for out in inputs.values()})
        cached = self.workdir.lookup(node, key)
        if cached is not None:
            return NodeOutcome(node, "cached", key, cached)
        self.reporter.start(node, key)
        started = time.time()
        tmp = self.workdir.new_temp(node.stage.name, key)
        ctx = StageContext(node=node, out_dir=tmp / "files", inputs=inputs, progress=self.reporter.progress)
        try:
            with captured_output(tmp / LOG_FILE):
                result = node.stage.run(ctx)
            if (tmp / LOG_FILE).stat().st_size == 0:
                (tmp / LOG_FILE).unlink()  # nothing printed: no log
        except Deferred as e:
            self.workdir.discard(tmp)
            return NodeOutcome(node, "deferred", key, reason=e.message, details=e.details)
        except KilnError as e:
            log = self.workdir.keep_log(node, tmp)
            self.workdir.discard(tmp)
            e.details.setdefault("stage", node.id)
            if log is not None:
                e.details.update(log=str(log), log_tail=log_tail(log))
            raise
        except BaseException as e:
            log = self.workdir.keep_log(node, tmp)
            self.workdir.discard(tmp)
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            details: dict[str, object] = {"stage": node.id}
            if log is not None:
                details.update(log=str(log), log_tail=log_tail(log))
            raise StageFailed(f"{node.id} failed: {type(e).__name__}: {e}", details=details) from e
        prov = provenance(node, key, inputs, started)
        if not node.stage.cacheable:
            self.workdir.discard(tmp)
            output = StageOutput(node.id, key, tmp, result, [], prov)
            return NodeOutcome(node, "ran", key, output, seconds=time.time() - started)
        output = self.workdir.commit(node, key, tmp, result, prov)
        return NodeOutcome(node, "built", key, output, seconds=time.time() - started)
