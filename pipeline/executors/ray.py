"""The Ray executor: the stage graph as Ray tasks, each on a node that has what the stage needs.

Ray is the scheduler. Every stage the cluster can run is submitted at once as a task whose arguments
are its inputs' tasks, so Ray starts it when they finish, on a node with the stage's resources:
`num_cpus` and `memory` from its requirements (the CPUs capped at the largest node's, since the
thread count a stage computes with is fixed by its requirements, not by the node), and the custom
resource `accelerator:<sku>` when it needs one (start a node with `--resources='{"accelerator:h100": 1}'`).
Independent stages run in parallel.

A stage on GPUs asks Ray for the count its requirements computed from the model's shape
(`pipeline.requirements`: one for a compute stage placed on a GPU by `--device cuda`, or `auto` on a
cluster with GPUs, `placement`; the tensor-parallel degree for a serving runtime's eval), and `memory` is
the host memory it needs besides; Ray sets the worker's `CUDA_VISIBLE_DEVICES` to the GPUs it granted,
and the stage computes on `cuda` (the first of them); every other task asks for none. Which GPU is Ray's
choice, so a device index (`cuda:1`) is refused here. A GPU no CUDA device is behind (a count on a node
that has none) fails the stage with DEVICE_UNAVAILABLE: it never falls back to computing on the CPU.

Stages exchange data only through the stage store: a task gets its inputs' (node, key) and reads
them from the store (`--store s3://...`; each Ray node keeps its local copy under
`<work-dir>/nodes/<ray node id>/`); with no shared store, every node must see the work directory on
one disk (a cluster on one machine). A task returns the output's stage.json fields, not its files.

- A worker that dies (a node lost, the process killed) is retried by Ray, up to `max_retries` times;
  a stage that raises a kiln error is not (`retry_exceptions=False`) and fails, and Ray never runs
  what waits on it: those stages are reported `cancelled`, with the failure they waited on. Stages
  that do not depend on it go on. A failed stage leaves no visible output (the store's temporary
  directories of a dead worker are swept by the next run on that node).
- A stage whose accelerator no node of the cluster offers, or whose memory no node has, is not
  submitted: it is reported `deferred`, waiting for that hardware (named), with everything that
  waits on it, and the build ends by today's exit-code rules.
- Stages that read this machine's files (ingest, from the recipe's source directory) or talk to the
  registry named on the command line (publish, seal) run here, in the driver.
- Provenance records where each stage ran: the Ray node id, host, node IP and the node's accelerators.

A build resumed after the driver died reuses every stage the store holds: a task first looks its
output up, as every executor does.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from kiln.core.device import CPU, Device, InvalidDevice, parse_device
from kiln.core.error_codes import Codes
from kiln.core.errors import KilnError, StageFailed
from kiln.pipeline.executors.node import NodeOutcome, Reporter, SilentReporter, run_node
from kiln.pipeline.stage import Node, StageOutput
from kiln.pipeline.store import StageStore, open_store, require_input

DEFAULT_MAX_RETRIES = 3
NODES_DIR = "nodes"  # <work-dir>/nodes/<ray node id>/: a Ray node's copy of a shared store


class RayExecutor:
    """Runs a graph on the Ray cluster at `address` (None: a local one started for the build)."""

    def __init__(
        self,
        store: StageStore,
        store_url: str | None,
        *,
        address: str | None = None,
        reporter: Reporter | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        self.store = store
        self.store_url = store_url
        self.address = address
        self.reporter = reporter or SilentReporter()
        self.max_retries = max_retries

    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(
                address=self.address,
                namespace="kiln",
                log_to_driver=False,
                include_dashboard=False,
                configure_logging=False,
            )

    def placement(self, spec: str | Device) -> Device:
        """The device the compute stages are placed on: `cpu`; `cuda` (a GPU Ray grants, on a node that has
        one; with none in the cluster those stages are deferred until one joins); `auto`: `cuda` when a
        live node offers a GPU, else the CPU."""
        device = parse_device(spec) if isinstance(spec, str) else spec
        if device is not None and device.kind == "cpu":
            return device
        if device is not None and device.index is not None:
            raise InvalidDevice(
                f"--device {device} with the Ray executor: Ray chooses the GPU a stage gets; use --device cuda",
                details={"device": str(device)},
            )
        if device is not None:
            return device
        self._connect()
        return Device("cuda") if _cluster_capacity()["max_gpus"] > 0 else CPU

    def run(self, nodes: list[Node]) -> dict[str, NodeOutcome]:
        import ray

        self._connect()
        self.store.sweep_stale()
        capacity = _cluster_capacity()
        task = ray.remote(_run_task)
        outcomes: dict[str, NodeOutcome] = {}
        pending: dict[str, Any] = {}  # node id -> the ObjectRef of its task
        for node in nodes:
            missing = [i for i in node.inputs.values() if i not in outcomes and i not in pending]
            if missing:
                raise KilnError(f"{node.id} runs before its inputs {missing}", code=Codes.GRAPH_ORDER)
            if node.stage.on_driver:
                # Its inputs must be finished first: collect them (in order), then run it here.
                for i in node.inputs.values():
                    if i in pending:
                        self._collect(nodes, i, pending, outcomes)
                outcomes[node.id] = self._run_here(node, outcomes)
                self.reporter.finish(outcomes[node.id])
                continue
            waiting = [i for i in node.inputs.values() if i in outcomes and outcomes[i].status == "deferred"]
            if waiting:
                outcomes[node.id] = NodeOutcome(node, "deferred", reason=f"waits on {', '.join(waiting)}")
                self.reporter.finish(outcomes[node.id])
                continue
            lacking = _lacking(node, capacity)
            if lacking is not None:
                outcomes[node.id] = NodeOutcome(node, "deferred", reason=lacking["reason"], details=lacking)
                self.reporter.finish(outcomes[node.id])
                continue
            roles = list(node.inputs)
            args = [pending.get(node.inputs[r]) or _done(outcomes[node.inputs[r]]) for r in roles]
            input_nodes = {r: self._node(nodes, node.inputs[r]) for r in roles}
            options = {
                "num_cpus": min(node.requires.cpus, capacity["max_cpus"]),
                "num_gpus": node.requires.gpus,
                "resources": node.requires.ray_resources(),
                "max_retries": self.max_retries,
                "retry_exceptions": False,
                "name": node.id,
            }
            if node.requires.memory_bytes:
                options["memory"] = min(node.requires.memory_bytes, capacity["max_memory"])
            pending[node.id] = task.options(**options).remote(
                node, input_nodes, roles, self.store_url, str(self.store.local.root), *args
            )
        for node in nodes:
            if node.id in pending:
                self._collect(nodes, node.id, pending, outcomes)
        return {n.id: outcomes[n.id] for n in nodes}

    def _node(self, nodes: list[Node], node_id: str) -> Node:
        return next(n for n in nodes if n.id == node_id)

    def _run_here(self, node: Node, outcomes: dict[str, NodeOutcome]) -> NodeOutcome:
        """A driver stage: after its inputs, in this process, from the store."""
        stuck = [i for i in node.inputs.values() if outcomes[i].status in ("deferred", "failed", "cancelled")]
        if stuck:
            status = "deferred" if all(outcomes[i].status == "deferred" for i in stuck) else "cancelled"
            return NodeOutcome(node, status, reason=f"waits on {', '.join(stuck)}")  # type: ignore[arg-type]
        inputs = {
            role: require_input(self.store, outcomes[i].node, outcomes[i].key or "") for role, i in node.inputs.items()
        }
        try:
            return run_node(self.store, node, inputs, self.reporter, where=_where_driver)
        except KilnError as e:
            return NodeOutcome(node, "failed", reason=e.message, error=e)

    def _collect(
        self, nodes: list[Node], node_id: str, pending: dict[str, Any], outcomes: dict[str, NodeOutcome]
    ) -> None:
        import ray
        from ray.exceptions import RayTaskError, WorkerCrashedError

        if node_id in outcomes:
            return
        node = self._node(nodes, node_id)
        ref = pending[node_id]
        try:
            done = ray.get(ref)
        except RayTaskError as e:
            outcomes[node_id] = self._failure(node, e.cause if isinstance(e.cause, BaseException) else e, outcomes)
        except WorkerCrashedError as e:
            error = StageFailed(
                f"{node_id}: its worker died {self.max_retries + 1} times ({e})",
                code=Codes.STAGE_WORKER_LOST,
                details={"stage": node_id, "attempts": self.max_retries + 1},
            )
            outcomes[node_id] = NodeOutcome(node, "failed", reason=error.message, error=error)
        else:
            outcomes[node_id] = _outcome(node, done, self.store)
        self.reporter.finish(outcomes[node_id])

    def _failure(self, node: Node, cause: BaseException, outcomes: dict[str, NodeOutcome]) -> NodeOutcome:
        """The node's own failure, or `cancelled` when an input failed (Ray never ran it)."""
        failed = [i for i in node.inputs.values() if i in outcomes and outcomes[i].status in ("failed", "cancelled")]
        if failed:
            return NodeOutcome(node, "cancelled", reason=f"waits on {', '.join(failed)}, which failed")
        if isinstance(cause, KilnError):
            return NodeOutcome(node, "failed", reason=cause.message, error=cause)
        error = StageFailed(f"{node.id} failed: {type(cause).__name__}: {cause}", details={"stage": node.id})
        return NodeOutcome(node, "failed", reason=error.message, error=error)


def _done(outcome: NodeOutcome) -> dict[str, Any]:
    """What a finished input hands a task: where its output is (the task reads it from the store)."""
    return {"node": outcome.node.id, "status": outcome.status, "key": outcome.key, "reason": outcome.reason}


def _outcome(node: Node, done: dict[str, Any], store: StageStore) -> NodeOutcome:
    output = None
    if done.get("result") is not None:
        from kiln.core.manifest import FileEntry

        output = StageOutput(
            node_id=node.id,
            key=done["key"],
            path=store.local.final_path(node.stage.name, done["key"]),
            result=node.stage.record.model_validate(done["result"]),
            files=[FileEntry.model_validate(f) for f in done["files"]],
            provenance=done["provenance"],
        )
    return NodeOutcome(
        node,
        done["status"],
        done["key"],
        output,
        reason=done.get("reason", ""),
        seconds=done.get("seconds", 0.0),
        details=done.get("details", {}),
    )


def _run_task(
    node: Node, input_nodes: dict[str, Node], roles: list[str], store_url: str | None, work_root: str, *inputs: Any
) -> dict[str, Any]:
    """One stage, in a Ray worker: its inputs from the store, its output committed to it."""
    import ray

    waiting = [i["node"] for i in inputs if i["status"] == "deferred"]
    if waiting:
        return {"node": node.id, "status": "deferred", "key": None, "reason": f"waits on {', '.join(waiting)}"}
    root = Path(work_root)
    if store_url is not None:  # a shared store: this Ray node's own copy, exchanged only through it
        root = root / NODES_DIR / ray.get_runtime_context().get_node_id()
    store = open_store(store_url, root)
    store.sweep_stale()
    ins = {role: require_input(store, input_nodes[role], i["key"]) for role, i in zip(roles, inputs, strict=True)}
    outcome = run_node(store, node, ins, where=_where_ray)
    out = outcome.output
    return {
        "node": node.id,
        "status": outcome.status,
        "key": outcome.key,
        "reason": outcome.reason,
        "seconds": outcome.seconds,
        "details": outcome.details,
        "result": out.result.model_dump(mode="json") if out is not None else None,
        "files": [f.model_dump() for f in out.files] if out is not None else [],
        "provenance": out.provenance if out is not None else {},
    }


def _where_ray() -> dict[str, Any]:
    import ray

    ctx = ray.get_runtime_context()
    node_id = ctx.get_node_id()
    info: dict[str, Any] = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    return {
        "executor": "ray",
        "ray_node_id": node_id,
        "host": socket.gethostname(),
        "node_ip": info.get("NodeManagerAddress"),
        "accelerators": sorted(r.split(":", 1)[1] for r in info.get("Resources", {}) if r.startswith("accelerator:")),
        # The GPUs Ray granted this task (none for a CPU stage) and the mask it set for them.
        "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
    }


def _where_driver() -> dict[str, Any]:
    return {"executor": "ray", "ray_node_id": None, "host": socket.gethostname(), "driver": True, "pid": os.getpid()}


def _cluster_capacity() -> dict[str, Any]:
    """What the cluster's live nodes offer: the largest CPU count, memory and GPU count, and every accelerator."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not alive:
        raise StageFailed("the Ray cluster has no live node", code=Codes.RAY_CLUSTER_EMPTY)
    resources = [n.get("Resources", {}) for n in alive]
    return {
        "max_cpus": max(int(r.get("CPU", 0)) for r in resources) or 1,
        "max_memory": max(int(r.get("memory", 0)) for r in resources),
        "max_gpus": max(int(r.get("GPU", 0)) for r in resources),
        "accelerators": {k for r in resources for k in r if k.startswith("accelerator:")},
    }


def _lacking(node: Node, capacity: dict[str, Any]) -> dict[str, Any] | None:
    """Why no node of the cluster can run `node` (an accelerator or memory no node has), or None."""
    req = node.requires
    missing = [r for r in req.ray_resources() if r not in capacity["accelerators"]]
    if missing:
        return {
            "reason": f"waits for a node with {req.accelerator}: no node of the cluster offers {missing[0]}",
            "runner": req.accelerator,
            "waiting_for": missing,
        }
    if req.gpus > capacity["max_gpus"]:
        return {
            "reason": f"waits for a node with {req.gpus} GPU(s): no node of the cluster offers one "
            "(placed on a GPU by --device)",
            "runner": "gpu",
            "waiting_for": ["GPU"],
        }
    if req.memory_bytes > capacity["max_memory"] > 0:
        gib = req.memory_bytes / 2**30
        return {
            "reason": f"waits for a node with {gib:.1f} GiB of memory: the largest has "
            f"{capacity['max_memory'] / 2**30:.1f} GiB",
            "runner": f"memory >= {gib:.1f} GiB",
            "waiting_for": ["memory"],
        }
    return None
