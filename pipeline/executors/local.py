"""The embedded executor: runs a stage graph on this machine, one stage at a time, reusing the store.

What a stage's libraries print (transformers and llm-compressor logs, progress bars, llama.cpp's C
output, subprocesses) is captured at the file-descriptor level into the stage's `stage.log`, kept
beside its `stage.json`; the terminal shows kiln's own lines. When a stage fails, its log is kept
under `<work>/logs/` and the error names it and quotes its last lines (`pipeline.executors.node`).
"""

from __future__ import annotations

from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError
from kiln.pipeline.executors.node import NodeOutcome, Reporter, SilentReporter, run_node
from kiln.pipeline.stage import Node
from kiln.pipeline.store import StageStore


class LocalExecutor:
    def __init__(self, store: StageStore, reporter: Reporter | None = None):
        self.store = store
        self.reporter = reporter or SilentReporter()

    def run(self, nodes: list[Node]) -> dict[str, NodeOutcome]:
        """Run every node whose output is not stored; a failure stops the run and leaves no partial output."""
        self.store.sweep_stale()
        outcomes: dict[str, NodeOutcome] = {}
        for node in nodes:
            missing = [i for i in node.inputs.values() if i not in outcomes]
            if missing:
                raise KilnError(f"{node.id} runs before its inputs {missing}", code=Codes.GRAPH_ORDER)
            blocked = [i for i in node.inputs.values() if outcomes[i].status == "deferred"]
            if blocked:
                outcomes[node.id] = NodeOutcome(node, "deferred", reason=f"waits on {', '.join(blocked)}")
                self.reporter.finish(outcomes[node.id])
                continue
            inputs = {role: outcomes[i].output for role, i in node.inputs.items()}
            outcomes[node.id] = run_node(self.store, node, inputs, self.reporter)  # type: ignore[arg-type]  # none deferred: all have output
            self.reporter.finish(outcomes[node.id])
        return outcomes
