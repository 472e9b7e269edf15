"""The embedded executor: runs a stage graph on this machine, one stage at a time, reusing the cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kiln.errors import Deferred, KilnError, StageFailed
from pipeline.stage import Node, StageContext, StageOutput, WorkDir, provenance

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
            missing = [i for i in node.inputs if i not in outcomes]
            if missing:
                raise KilnError(f"{node.id} runs before its inputs {missing}", code="GRAPH_ORDER")
            blocked = [i for i in node.inputs if outcomes[i].status == "deferred"]
            if blocked:
                outcomes[node.id] = NodeOutcome(node, "deferred", reason=f"waits on {', '.join(blocked)}")
                self.reporter.finish(outcomes[node.id])
                continue
            outcomes[node.id] = self._run_one(node, {i: outcomes[i].output for i in node.inputs})  # type: ignore[misc]
            self.reporter.finish(outcomes[node.id])
        return outcomes

    def _run_one(self, node: Node, inputs: dict[str, StageOutput]) -> NodeOutcome:
        key = node.cache_key({nid: out.digest for nid, out in inputs.items()})
        cached = self.workdir.lookup(node, key)
        if cached is not None:
            return NodeOutcome(node, "cached", key, cached)
        self.reporter.start(node, key)
        started = time.time()
        tmp = self.workdir.new_temp(node.stage.name, key)
        ctx = StageContext(node=node, out_dir=tmp / "files", inputs=inputs, progress=self.reporter.progress)
        try:
            result = node.stage.run(ctx)
        except Deferred as e:
            self.workdir.discard(tmp)
            return NodeOutcome(node, "deferred", key, reason=e.message, details=e.details)
        except KilnError as e:
            self.workdir.discard(tmp)
            e.details.setdefault("stage", node.id)
            raise
        except BaseException as e:
            self.workdir.discard(tmp)
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            raise StageFailed(f"{node.id} failed: {type(e).__name__}: {e}", details={"stage": node.id}) from e
        prov = provenance(node, key, inputs, started)
        if not node.stage.cacheable:
            self.workdir.discard(tmp)
            output = StageOutput(node.id, key, tmp, result, [], prov)
            return NodeOutcome(node, "ran", key, output, seconds=time.time() - started)
        output = self.workdir.commit(node, key, tmp, result, prov)
        return NodeOutcome(node, "built", key, output, seconds=time.time() - started)
