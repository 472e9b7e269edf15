"""From a recipe to a stage graph, and running it: the `kiln build` / `kiln plan` / `kiln publish` core."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.digest import HashCache
from pipeline.executors.local import LocalExecutor, NodeOutcome, Reporter
from pipeline.ingest import open_source
from pipeline.recipe import Recipe, TargetEntry
from pipeline.stage import Node, WorkDir
from pipeline.stages import engine as engine_stage
from pipeline.stages import eval as eval_stage
from pipeline.stages import export as export_stage
from pipeline.stages import ingest as ingest_stage
from pipeline.stages import publish as publish_stage
from pipeline.stages import quantize as quantize_stage
from pipeline.stages import reference as reference_stage
from targets.base import get_target

HASH_CACHE = "hash-cache.json"


def plan(recipe: Recipe, work_dir: Path, *, registry: str | None = None) -> list[Node]:
    """The stage graph in run order. With `registry`, publish nodes are added after each eval."""
    hashes = HashCache(work_dir / HASH_CACHE)
    source = open_source(recipe.source_dir, hasher=hashes.sha256)
    text_digest = hashes.sha256(recipe.eval_text)
    calibration_digest = hashes.sha256(recipe.calibration_text)
    hashes.save()
    ingest = ingest_stage.node(source, recipe.source_dir, work_dir / HASH_CACHE)
    ev = recipe.eval
    reference = Node(
        "reference/source",
        reference_stage.STAGE,
        params={
            "window": ev.window,
            "max_tokens": ev.max_tokens,
            "greedy_prompts": ev.greedy_prompts,
            "greedy_tokens": ev.greedy_tokens,
        },
        inputs=(ingest.id,),
        external={"text": text_digest},
        args={"text": str(recipe.eval_text)},
    )
    nodes = [ingest, reference]
    quantized: dict[str, Node] = {}  # one quantize node per scheme, shared by every target that needs it
    for name, entry, quant in recipe.artifacts():
        spec = get_target(entry.target)
        export_inputs: tuple[str, ...] = (ingest.id,)
        if quant in spec.quantized_input:
            if quant not in quantized:
                from targets.schemes import get_scheme

                scheme = get_scheme(quant)
                params: dict[str, Any] = {"scheme": scheme.model_dump(mode="json")}
                external, args = {}, {}
                if scheme.calibrated:
                    cal = recipe.calibration
                    params["calibration"] = {
                        "samples": cal.samples,
                        "seq_len": cal.seq_len,
                        "skip_tokens": recipe.calibration_skip_tokens,
                    }
                    external = {"calibration_text": calibration_digest}
                    args = {"calibration_text": str(recipe.calibration_text)}
                quantized[quant] = Node(
                    f"quantize/{quant}",
                    quantize_stage.STAGE,
                    params=params,
                    inputs=(ingest.id,),
                    external=external,
                    args=args,
                )
                nodes.append(quantized[quant])
            export_inputs = (ingest.id, quantized[quant].id)
        export = Node(
            f"export/{name}",
            export_stage.STAGE,
            params={
                "artifact": name,
                "model": recipe.model,
                "target": spec.name,
                "target_code_version": spec.code_version,
                "quant": quant,
                "params": entry.params,
                "hardware": entry.hardware,
            },
            inputs=export_inputs,
        )
        from eval.gates import gate_for

        gate = gate_for(quant, ev.gates.get(quant))
        evaluate = Node(
            f"eval/{name}",
            eval_stage.STAGE,
            params={"artifact": name, "quant": quant, "gate": gate.model_dump()},
            inputs=(ingest.id, reference.id, export.id),
        )
        nodes += [export, evaluate]
        if registry is not None:
            nodes.append(
                Node(
                    f"publish/{name}",
                    publish_stage.STAGE,
                    params={
                        "model": recipe.model,
                        "version": recipe.version,
                        "artifact": name,
                        "description": recipe.description,
                    },
                    inputs=(ingest.id, export.id, evaluate.id),
                    args={"registry": registry},
                )
            )
        for engine in _engine_nodes(entry, name, quant, export):
            nodes.append(engine)
            if registry is not None:
                nodes.append(
                    Node(
                        f"publish/{engine.params['artifact']}",
                        publish_stage.STAGE,
                        params={
                            "model": recipe.model,
                            "version": recipe.version,
                            "artifact": engine.params["artifact"],
                            "description": recipe.description,
                        },
                        inputs=(ingest.id, engine.id),
                        args={"registry": registry},
                    )
                )
    return nodes


def _engine_nodes(entry: TargetEntry, name: str, quant: str, export: Node) -> list[Node]:
    """One engine node per SKU of a trtllm entry's `params.engines` (none for other targets)."""
    if entry.target != "trtllm" or entry.params.get("engines") is None:
        return []
    from targets.trtllm.engines import build_command, parse_params

    matrix = parse_params(entry.params).engines
    assert matrix is not None
    limits = {
        "max_batch_size": matrix.max_batch_size,
        "max_input_len": matrix.max_input_len,
        "max_seq_len": matrix.max_seq_len,
    }
    return [
        Node(
            f"engine/{name}-{sku}",
            engine_stage.STAGE,
            params={
                "artifact": f"{name}-{sku}",
                "quant": quant,
                "sku": sku,
                "limits": limits,
                "tensorrt_llm": matrix.tensorrt_llm,
                "command": build_command(quant, sku, matrix),
            },
            inputs=(export.id,),
        )
        for sku in matrix.skus
    ]


@dataclass
class BuildResult:
    recipe: Recipe
    outcomes: dict[str, NodeOutcome]

    def artifacts(self) -> list[dict[str, Any]]:
        """One row per artifact: where it is, its size and its eval outcome."""
        rows = []
        for name, _entry, quant in self.recipe.artifacts():
            export = self.outcomes[f"export/{name}"]
            ev = self.outcomes[f"eval/{name}"]
            report = ev.output.result if ev.output else None
            rows.append(
                {
                    "artifact": name,
                    "quant": quant,
                    "export": export.status,
                    "path": str(export.output.files_dir) if export.output else None,
                    "size": sum(f.size for f in export.output.files) if export.output else None,
                    "eval": report["status"] if report else ev.status,
                    "metrics": report.get("metrics") if report else None,
                    "failures": report.get("failures", []) if report else [],
                    "published": self.outcomes[f"publish/{name}"].status
                    if f"publish/{name}" in self.outcomes
                    else None,
                    "reason": report.get("reason") if report else ev.reason or None,
                }
            )
        for node_id, engine in self.outcomes.items():
            if node_id.startswith("engine/"):
                rows.append(_engine_row(engine, self.outcomes.get(f"publish/{engine.node.params['artifact']}")))
        return rows

    @property
    def deferred(self) -> list[dict[str, Any]]:
        """Every deferred stage: why, and (for work that needs a runner) the runner and the command."""
        return [
            {"node": node_id, "reason": o.reason, **o.details}
            for node_id, o in self.outcomes.items()
            if o.status == "deferred"
        ]

    @property
    def failed_gates(self) -> list[str]:
        return [r["artifact"] for r in self.artifacts() if r["eval"] == "failed"]

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for o in self.outcomes.values():
            counts[o.status] = counts.get(o.status, 0) + 1
        return {
            "model": self.recipe.model,
            "version": self.recipe.version,
            "stages": counts,
            "artifacts": self.artifacts(),
            "failed_gates": self.failed_gates,
            "deferred": self.deferred,
        }


def _engine_row(engine: NodeOutcome, publish: NodeOutcome | None) -> dict[str, Any]:
    """An engine's row in the build report: where it is, or the runner it is deferred to."""
    p, out = engine.node.params, engine.output
    return {
        "artifact": p["artifact"],
        "quant": p["quant"],
        "sku": p["sku"],
        "export": engine.status,
        "path": str(out.files_dir) if out else None,
        "size": sum(f.size for f in out.files) if out else None,
        # An engine is not evaluated by kiln: its runtime is tensorrt_llm on that SKU.
        "eval": "deferred" if engine.status == "deferred" else "not_evaluated",
        "metrics": None,
        "failures": [],
        "published": publish.status if publish else None,
        "reason": engine.reason or None,
        "runner": engine.details.get("runner"),
        "command": p["command"],
    }


def run(
    recipe: Recipe, work_dir: Path, *, registry: str | None = None, reporter: Reporter | None = None
) -> BuildResult:
    nodes = plan(recipe, work_dir, registry=registry)
    outcomes = LocalExecutor(WorkDir(work_dir), reporter).run(nodes)
    return BuildResult(recipe, outcomes)


def status(recipe: Recipe, work_dir: Path) -> list[dict[str, Any]]:
    """What `kiln plan` shows: each node, its cache key, and whether its output is already there."""
    workdir = WorkDir(work_dir)
    nodes = plan(recipe, work_dir)
    digests: dict[str, str | None] = {}
    deferred: set[str] = set()
    rows = []
    for node in nodes:
        ins = [digests.get(i) for i in node.inputs]
        if all(d is not None for d in ins):
            key: str | None = node.cache_key({i: d for i, d in zip(node.inputs, ins, strict=True)})  # type: ignore[misc]
            out = workdir.lookup(node, key)  # type: ignore[arg-type]
            digests[node.id] = out.digest if out else None
            state = "cached" if out else "to build"
        else:
            key, state = None, "to build"
            digests[node.id] = None
        extra: dict[str, Any] = {}
        # A stage this machine cannot run is deferred to a runner (and so is everything that waits on it).
        blocked = [i for i in node.inputs if i in deferred]
        needs = node.stage.deferral(node) if node.stage.deferral is not None and state != "cached" else None
        if needs is not None:
            state, extra = "deferred", needs
        elif blocked:
            state, extra = "deferred", {"reason": f"waits on {', '.join(blocked)}"}
        if state == "deferred":
            deferred.add(node.id)
        rows.append(
            {
                "node": node.id,
                "stage": node.stage.name,
                "inputs": list(node.inputs),
                "key": key,
                "state": state,
                "resources": node.stage.resources,
                **extra,
            }
        )
    return rows
