"""From a recipe to a stage graph, and running it: the `kiln build` / `kiln plan` / `kiln publish` core.

The graph, per recipe: one ingest and one reference node; one quantize node per scheme that some
target consumes and one prepare node per target that does work once per source (both shared by
the exports that need them); per artifact an export and an eval node, and the nodes of what its
target adds per artifact (`TargetSpec.derived`: a GPU eval per SKU, a legacy engine per SKU). With a registry,
a publish node per artifact and one seal node waiting for them all. Nothing here names a target.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

from kiln.core import __version__
from kiln.core.device import CPU, Device, resolve_device
from kiln.core.digest import HashCache, sha256_json
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput, StageFailed, UnknownName
from kiln.core.hardware import PROFILES, get_profile
from kiln.eval.gates import gate_for
from kiln.eval.report import EvalReport
from kiln.eval.runtimes.facts import RUNTIME_FACTS
from kiln.formats.hf_model import UNRECORDED_DIGEST, SourceModel, open_shape, open_source
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.executors.node import NodeOutcome, Reporter, Status, run_node
from kiln.pipeline.machine import Machine, this_machine
from kiln.pipeline.placement import computes_on_device, placed, with_device
from kiln.pipeline.recipe import Recipe
from kiln.pipeline.records import (
    ArtifactRecord,
    CalibrationParams,
    DerivedParams,
    EvalParams,
    ExportParams,
    IgnoredFile,
    IngestParams,
    IngestRecord,
    PrepareParams,
    PublishParams,
    QuantizeParams,
    ReferenceParams,
    SealParams,
)
from kiln.pipeline.remote_source import S3Source
from kiln.pipeline.report import (
    BuildSummary,
    BuiltArtifact,
    DeferredStage,
    DeviceMisfit,
    DiskMisfit,
    DiskUse,
    Matrix,
    MatrixEntry,
    MatrixLevel,
    MemoryMisfit,
    Misfits,
    PlanRow,
    PlanState,
    RuntimeEval,
)
from kiln.pipeline.requirements import (
    PlanDevice,
    Sizing,
    catalog_gpu,
    plan_device,
    runner_labels,
    stage_kind,
    stage_work,
)
from kiln.pipeline.stage import Node, distribution_version
from kiln.pipeline.stages import derived as derived_stage
from kiln.pipeline.stages import eval as eval_stage
from kiln.pipeline.stages import export as export_stage
from kiln.pipeline.stages import ingest as ingest_stage
from kiln.pipeline.stages import prepare as prepare_stage
from kiln.pipeline.stages import publish as publish_stage
from kiln.pipeline.stages import quantize as quantize_stage
from kiln.pipeline.stages import reference as reference_stage
from kiln.pipeline.stages import seal as seal_stage
from kiln.pipeline.store import StageInputMissing, StageStore, require_input
from kiln.placement.cost import Rates, StageWork, build_host_rates, device_rates, estimate, seconds
from kiln.placement.weights import source_bytes
from kiln.quant.calibrated import calibration_dtype
from kiln.quant.catalog import SCHEMES, check_source, get_method, get_scheme
from kiln.quant.rtn import HeadTied, check_shapes
from kiln.targets.base import TargetSpec, get_target

HASH_CACHE = "hash-cache.json"
SOURCES_DIR = "sources"  # header mirrors of sources in a bucket, by listing
SOURCE_CHECKS_DIR = "source-checks"  # a file per source check passed (`_check_source`)


class SourceShapeOnly(InvalidInput):
    """A build (or one stage of it) of a recipe whose source is shape-only: config.json, no weights."""

    code = Codes.SOURCE_SHAPE_ONLY


def refuse_shape_only(recipe: Recipe) -> None:
    """SOURCE_SHAPE_ONLY for a recipe whose source is config.json alone: it is planned, never built."""
    if recipe.is_shape_only:
        why = "`shape_only: true`" if recipe.shape_only else "no weights beside it"
        raise SourceShapeOnly(
            f"{recipe.model}@{recipe.version}: the source {str(recipe.source_dir)!r} is shape-only (config.json "
            f"alone, {why}): `kiln plan` sizes its stages, but building needs the weights and "
            "tokenizer (a source directory of SafeTensors)",
            details={"source": str(recipe.source_dir)},
        )


@dataclass(frozen=True)
class PlannedArtifact:
    """An artifact of the build: the node that makes it and the nodes that evaluate it, published with it:
    one per runtime that serves it here (the first its primary), one per GPU SKU it is evaluated on.
    None evaluate an artifact kiln does not evaluate (an engine): its runtime's runner does."""

    name: str
    quant: str
    maker: Node
    evaluators: tuple[Node, ...] = ()


def eval_column(node: Node) -> str:
    """The name an evaluating node's report has in the registry: its runtime, `@<sku>` for one GPU SKU's."""
    if node.stage is eval_stage.STAGE:
        return EvalParams.model_validate(node.params).runtime
    p = DerivedParams.model_validate(node.params)  # a target's eval on a GPU runner
    return f"{p.runtime}@{p.sku}"


def made_by(node: Node) -> ExportParams | DerivedParams:
    """The params of a node that makes an artifact: an export, or a target's derived stage (an engine)."""
    if node.stage is export_stage.STAGE:
        return ExportParams.model_validate(node.params)
    return DerivedParams.model_validate(node.params)


def plan(
    recipe: Recipe,
    store: StageStore,
    *,
    registry: str | None = None,
    device: Device = CPU,
    gpu: str | None = None,
    hash_source: bool = True,
) -> list[Node]:
    """The stage graph in run order, each node with its requirements. With `registry`, publish nodes and
    the seal node come last. The compute stages (the reference, calibration, the evals of runtimes that
    run on the stage's device) are placed on `device` (`pipeline.placement`): its kind is in their keys,
    and one on a GPU asks for it in its requirements, sized for the catalog's `gpu` when named, else for
    this machine's GPU (`pipeline.requirements.plan_device`).

    A local source's files are hashed once, through the work dir's stat-keyed hash cache, to key the ingest
    node. Without `hash_source` (`kiln plan`) nothing is hashed: the graph is planned from config.json, the
    headers, the sizes and the digests an earlier build recorded; a source some of whose files none recorded
    gets an ingest node without a key (`pipeline.stages.ingest.unhashed_node`), and every stage after it
    is to be built.

    While the graph is planned, before anything runs, what a stage would refuse of the model or the source is
    refused with the stage's own error: a scheme the model's shape does not fit (`quant.rtn.check_shapes`), a
    model a target cannot serve (`TargetSpec.check_model`), a source whose files (its tokenizer) a target cannot
    write (`TargetSpec.check_source`)."""
    return _plan(recipe, store, registry=registry, device=device, gpu=gpu, hash_source=hash_source)[0]


def _plan(
    recipe: Recipe,
    store: StageStore,
    *,
    registry: str | None = None,
    device: Device = CPU,
    gpu: str | None = None,
    hash_source: bool = True,
) -> tuple[list[Node], Sizing]:
    nodes, artifacts, sizing = _build_graph(recipe, store.local.root, device, hash_source)
    if registry is not None:
        nodes += _release_nodes(recipe, registry, nodes[0], artifacts, _deferred(nodes, stored(nodes, store)))
    sizing = replace(sizing, device=plan_device(device, gpu))
    return [replace(n, requires=placed(n, n.stage.requirements(n, sizing))) for n in nodes], sizing


def stage_costs(nodes: list[Node], sizing: Sizing) -> dict[str, StageWork]:
    """Each node's work (`pipeline.requirements.stage_work`): ingest reads the source, every other node what its
    inputs hold: what they wrote, and for ingest's output the source it links (or copied)."""
    source = source_bytes(sizing.shape, sizing.weight_bytes)
    work: dict[str, StageWork] = {}
    held: dict[str, int] = {}
    for node in nodes:
        read = source if not node.inputs else sum(held[i] for i in node.inputs.values())
        work[node.id] = stage_work(node, sizing, read)
        held[node.id] = source if not node.inputs else work[node.id].written_bytes
    return work


def _rates(node: Node, sizing: Sizing) -> Rates | None:
    """The rates of the device `node` computes on: its catalog GPU's, the build host's CPU; None for a GPU of
    unknown kind."""
    if not node.requires.gpus:
        return build_host_rates()
    gpu = sizing.device.gpu
    return device_rates(get_profile(gpu.sku)) if gpu is not None and gpu.sku is not None else None


class BuildDiskInsufficient(InvalidInput):
    """A build whose stages still to run would write more than the work dir's disk has free."""

    code = Codes.BUILD_DISK_INSUFFICIENT


def disk_needed(nodes: list[Node], work: dict[str, StageWork], pending: set[str]) -> int:
    """The disk the `pending` nodes take at their peak: everything they keep, and the largest scratch among them."""
    kept = sum(work[n.id].written_bytes for n in nodes if n.id in pending)
    return kept + max((work[n.id].scratch_bytes for n in nodes if n.id in pending), default=0)


def refuse_full_disk(nodes: list[Node], sizing: Sizing, store: StageStore, machine: Machine) -> None:
    """BUILD_DISK_INSUFFICIENT when the stages still to build here (not stored, not deferred) would write more than
    the work dir's disk has free."""
    done = stored(nodes, store)
    deferred = _deferred(nodes, done)
    pending = {n.id for n in nodes if done[n.id].digest is None and n.id not in deferred}
    work = stage_costs(nodes, sizing)
    need = disk_needed(nodes, work, pending)
    if need > machine.disk_free_bytes:
        raise BuildDiskInsufficient(
            f"the stages still to build write {need / 1e9:.1f} GB and {store.local.root} has "
            f"{machine.disk_free_bytes / 1e9:.1f} GB free: free {(need - machine.disk_free_bytes) / 1e9:.1f} GB, "
            "build fewer targets (or one stage at a time with `kiln run-stage`), or pass --force",
            details={
                "needed_bytes": need,
                "free_bytes": machine.disk_free_bytes,
                "stages": sorted(n for n in pending if work[n].disk_peak_bytes),  # those that write
            },
        )


def _build_graph(
    recipe: Recipe, work_dir: Path, device: Device = CPU, hash_source: bool = True
) -> tuple[list[Node], list[PlannedArtifact], Sizing]:
    hashes = HashCache(work_dir / HASH_CACHE)
    ev = recipe.eval
    budget = {
        "max_tokens": ev.max_tokens,
        "window": ev.window,
        "greedy_tokens": ev.greedy_tokens,
        "greedy_prompts": ev.greedy_prompts,
    }
    source: SourceModel | None = None  # None: a shape-only source, which has no files beyond config.json
    if recipe.is_shape_only:  # config.json alone: planned and sized, never built (`refuse_shape_only`)
        config, shape = open_shape(recipe.source_dir, allowed_roots=recipe.allowed_roots)
        sizing = Sizing.of_config(config, shape, **budget)
        ingest = Node(
            "ingest/source",
            ingest_stage.STAGE,
            params=IngestParams().as_params(),
            external={"source": sha256_json(config)},
            args={"source_dir": str(recipe.source_dir), "shape_only": True},
        )
    elif recipe.source_url is not None:  # a bucket: planned from its header mirror (pipeline.remote_source)
        remote = S3Source(recipe.source_url)
        listing = remote.listing()
        mirror = remote.mirror(work_dir / SOURCES_DIR / sha256_json(sorted(o.identity for o in listing.values())))
        source = open_source(mirror, hasher=lambda p: listing[p.name].identity)
        ingest = ingest_stage.remote_node(source, recipe.source_url)
        sizing = Sizing.of_source(source, **budget)
    else:
        ingest, source = _local_ingest(recipe, hashes, work_dir / HASH_CACHE, hash_source)
        sizing = Sizing.of_source(source, **budget)
    # A shape-only recipe may name no held-out text: its nodes are keyed without it (they never run).
    texts = recipe.eval.text is not None or recipe.calibration.text is not None
    text_digest = hashes.sha256(recipe.eval_text) if recipe.eval.text is not None else None
    calibration_digest = hashes.sha256(recipe.calibration_text) if texts else None
    hashes.save()
    reference = with_device(
        Node(
            "reference/source",
            reference_stage.STAGE,
            params=ReferenceParams(
                window=ev.window,
                max_tokens=ev.max_tokens,
                greedy_prompts=ev.greedy_prompts,
                greedy_tokens=ev.greedy_tokens,
                tail_mass=ev.tail_mass,
                max_entries=ev.max_entries,
            ).as_params(),
            inputs={"ingest": ingest.id},
            external={"text": text_digest} if text_digest is not None else {},
        ),
        device,
    )
    nodes = [ingest, reference]
    artifacts: list[PlannedArtifact] = []
    quantized: dict[str, Node] = {}  # one quantize node per scheme, shared by every target that needs it
    prepared: dict[str, Node] = {}  # one prepare node per target that has one, shared by its exports
    checked: set[str] = set()  # the targets that have checked the source's files
    for name, entry, quant in recipe.artifacts():
        spec = get_target(entry.target)
        if quant in SCHEMES:
            # The catalog says whether the scheme keeps a release's bytes, dequantizes them, or not, and refuses a
            # release's own layout for a plain source.
            check_source(get_method(quant), sizing.shape.source_quant)
        spec.check_model(sizing.shape, sizing.config, quant, entry.params)
        if source is not None and spec.name not in checked:  # its files (the tokenizer), once per target
            _check_source(spec, source, work_dir / SOURCE_CHECKS_DIR)
            checked.add(spec.name)
        export_inputs = {"ingest": ingest.id}
        if spec.prepare is not None:
            if spec.name not in prepared:
                prepared[spec.name] = Node(
                    f"prepare/{spec.name}",
                    prepare_stage.STAGE,
                    params=PrepareParams(target=spec.name, target_code_version=spec.code_version).as_params(),
                    inputs={"ingest": ingest.id},
                )
                nodes.append(prepared[spec.name])
            export_inputs["prepared"] = prepared[spec.name].id
        if quant in spec.quantized_input:
            if quant not in quantized:
                if recipe.lm_head(quant) == "quantized" and sizing.shape.tie_word_embeddings:
                    raise HeadTied(
                        f"quantize.{quant}.lm_head: quantized, but {recipe.model} ties lm_head to its embedding "
                        "(tie_word_embeddings), which stays bf16; keep lm_head for this model",
                        details={"quant": quant},
                    )
                # A model whose Linears do not fit the scheme (QUANT_SHAPE) is refused here, not after calibration.
                check_shapes(get_scheme(quant), sizing.shape.expected_tensors(), sizing.shape.merged_gemms())
                quantized[quant] = _quantize_node(recipe, quant, ingest, calibration_digest, device)
                nodes.append(quantized[quant])
            export_inputs["quantized"] = quantized[quant].id
        export = Node(
            f"export/{name}",
            export_stage.STAGE,
            params=ExportParams(
                artifact=name,
                model=recipe.model,
                target=spec.name,
                target_code_version=spec.code_version,
                quant=quant,
                params=entry.params,
                hardware=entry.hardware,
            ).as_params(),
            inputs=export_inputs,
        )
        # One eval per runtime that serves the artifact: `eval/<artifact>` for the first, `@<runtime>` after.
        evaluators = [
            _on_runtime_device(
                Node(
                    f"eval/{name}" if i == 0 else f"eval/{name}@{runtime}",
                    eval_stage.STAGE,
                    params=EvalParams(
                        artifact=name,
                        quant=quant,
                        runtime=runtime,
                        **eval_stage.runtime_params(runtime, device.kind),
                        gate=gate_for(quant, ev.gates.get(quant)),
                    ).as_params(),
                    inputs={"reference": reference.id, "export": export.id},
                ),
                runtime,
                device,
            )
            for i, runtime in enumerate(spec.runtimes_for(quant))
        ]
        nodes += [export, *evaluators]
        roles = {"export": export.id, "ingest": ingest.id, "reference": reference.id}
        made: list[PlannedArtifact] = []
        for derived in spec.derived(name, quant, entry.params, sizing.shape) if spec.derived is not None else []:
            # An eval on other hardware is judged by the same gate.
            gate = gate_for(quant, ev.gates.get(quant)) if derived.evaluates is not None else None
            node = Node(
                f"{derived.kind}/{derived.name}",
                derived_stage.stage_of(derived.stage),
                params=DerivedParams.model_validate({**derived.params, "gate": gate}).as_params(),
                inputs={role: roles[role] for role in derived.inputs},
            )
            nodes.append(node)
            if derived.evaluates is None:
                made.append(PlannedArtifact(derived.name, quant, node))
            else:
                evaluators.append(node)
        artifacts += [PlannedArtifact(name, quant, export, tuple(evaluators)), *made]
    return nodes, artifacts, sizing


def _check_source(spec: TargetSpec, source: SourceModel, passed: Path) -> None:
    """`spec.check_source(source)`, remembered once passed: a file under `passed` named by the digest of the
    target, its code version, the source's files and the libraries the check reads them with. A build planned
    again (warm, or a publish after a build) does not load the tokenizer again. A source whose files have no
    digest yet (planned from recorded digests, some unrecorded) is checked every time; the stage that writes the
    files checks them again when it runs either way."""
    if spec.check_source_fn is None:
        return
    if any(f.sha256 == UNRECORDED_DIGEST for f in source.files):
        spec.check_source(source)
        return
    libraries = {name: distribution_version(name) for name in ("transformers", "tokenizers")}
    key = sha256_json(
        {"target": spec.name, "code": [__version__, spec.code_version], "source": source.digest, **libraries}
    )
    if (passed / key).is_file():
        return
    spec.check_source(source)
    passed.mkdir(parents=True, exist_ok=True)
    (passed / key).touch()


def _local_ingest(recipe: Recipe, hashes: HashCache, hash_cache: Path, hash_source: bool) -> tuple[Node, SourceModel]:
    """The ingest node of a source on this machine (a directory, or a hub repo's snapshot in the hub cache),
    and the source checked from its headers. Its files are hashed (once: `hashes` remembers them by stat)
    only with `hash_source`; else their recorded digests key it, or it has no key yet."""
    origin = None
    roots = recipe.allowed_roots
    hub = recipe.source_hub
    if hub is not None:
        source_dir, origin = hub.fetch()
        # A snapshot's files are links into its repo's `blobs/` in the cache: `<repo>/snapshots/<commit>/`.
        roots = (*roots, source_dir.parent.parent)
    else:
        source_dir = recipe.source_dir
    unhashed: list[str] = []

    def recorded(path: Path) -> str:
        digest = hashes.recorded(path)
        if digest is None:
            unhashed.append(path.name)
            return UNRECORDED_DIGEST  # stands for a digest nobody recorded: this node gets no key
        return digest

    source = open_source(source_dir, hasher=hashes.sha256 if hash_source else recorded, allowed_roots=roots)
    if unhashed:
        return ingest_stage.unhashed_node(source, source_dir, unhashed), source
    return ingest_stage.node(source, source_dir, hash_cache, copy=recipe.source_copy, origin=origin), source


def _on_runtime_device(node: Node, runtime: str, device: Device) -> Node:
    """An eval node placed on `device` when its runtime runs on the stage's device (transformers, JAX)."""
    return with_device(node, device) if RUNTIME_FACTS[runtime].on_stage_device else node


def _quantize_node(
    recipe: Recipe, quant: str, ingest: Node, calibration_digest: str | None, device: Device = CPU
) -> Node:
    scheme = get_scheme(quant, recipe.lm_head(quant))
    calibration: dict[str, Any] = {}
    external = {}
    if scheme.calibrated:
        cal = recipe.calibration
        calibration = {"samples": cal.samples, "seq_len": cal.seq_len, "skip_tokens": recipe.calibration_skip_tokens}
        external = {"calibration_text": calibration_digest} if calibration_digest is not None else {}
    if scheme.by_llmcompressor:
        # What the device computes fast (a GPU: bf16; a CPU: quant.calibrated.calibration_dtype); it
        # changes the result, so it is part of the key (and recorded with the quantize stage).
        calibration["compute_dtype"] = calibration_dtype(device=device.kind)
    params = QuantizeParams(scheme=scheme, calibration=CalibrationParams(**calibration) if calibration else None)
    node = Node(
        f"quantize/{quant}",
        quantize_stage.STAGE,
        params=params.as_params(),
        inputs={"ingest": ingest.id},
        external=external,
    )
    return with_device(node, device) if scheme.by_llmcompressor else node


@dataclass(frozen=True)
class Stored:
    """What the store says of a planned node: its key (when every input is stored), and its output's digest."""

    key: str | None
    digest: str | None


def stored(nodes: list[Node], store: StageStore) -> dict[str, Stored]:
    """Each node's key and stored digest, in plan order, without materialising any output."""
    found: dict[str, Stored] = {}
    for node in nodes:
        digests = {i: found[i].digest for i in node.inputs.values()}
        if any(d is None for d in digests.values()):
            found[node.id] = Stored(None, None)
            continue
        key = node.cache_key({i: d for i, d in digests.items() if d is not None})
        found[node.id] = Stored(key, store.digest(node, key))
    return found


def _deferred(nodes: list[Node], done: dict[str, Stored]) -> set[str]:
    """Nodes this machine cannot run (a stage's deferral says so) and another has not (their output is not in
    the store), and every node that waits on one."""
    deferred: set[str] = set()
    for node in nodes:
        made = done.get(node.id, Stored(None, None)).digest is not None
        own = node.stage.deferral(node) if node.stage.deferral is not None and not made else None
        if own is not None or deferred & set(node.inputs.values()):
            deferred.add(node.id)
    return deferred


def _release_nodes(
    recipe: Recipe, registry: str, ingest: Node, artifacts: list[PlannedArtifact], deferred: set[str]
) -> list[Node]:
    """A publish node per artifact, then the seal node that waits for all of them.

    The release plans the artifacts this build can make: one deferred to a runner (an engine for a
    GPU this machine lacks) is never published, so it is not planned, and the release seals without it.
    """
    planned = [a.name for a in artifacts if a.maker.id not in deferred]
    publish: dict[str, Node] = {}  # by artifact
    for a in artifacts:
        inputs = {"ingest": ingest.id, "artifact": a.maker.id}
        # Each eval is published with the artifact once it is made (here, or by its runner into the
        # store), under its registry name; one still waiting for its runner does not hold the artifact back.
        for evaluator in a.evaluators:
            if evaluator.id not in deferred:
                inputs[f"eval@{eval_column(evaluator)}"] = evaluator.id
        publish[a.name] = Node(
            f"publish/{a.name}",
            publish_stage.STAGE,
            params=PublishParams(
                model=recipe.model,
                version=recipe.version,
                artifact=a.name,
                description=recipe.description,
                planned=planned,
                recipe_digest=recipe.digest(),
            ).as_params(),
            inputs=inputs,
            args={"registry": registry},
        )
    seal = Node(
        "seal/release",
        seal_stage.STAGE,
        params=SealParams(model=recipe.model, version=recipe.version, artifacts=planned).as_params(),
        inputs={name: n.id for name, n in publish.items() if name in planned},
        args={"registry": registry},
    )
    return [*publish.values(), seal]


@dataclass
class BuildResult:
    recipe: Recipe
    nodes: list[Node]
    outcomes: dict[str, NodeOutcome]

    def artifacts(self) -> list[BuiltArtifact]:
        """One row per artifact: where it is, its size, and its eval outcome (or the runner it waits for)."""
        evaluators: dict[str, list[Node]] = {}
        for n in self.nodes:
            if n.stage is eval_stage.STAGE:
                evaluators.setdefault(EvalParams.model_validate(n.params).artifact, []).append(n)
        rows = []
        for n in self.nodes:
            if n.stage.record is ArtifactRecord:  # the nodes that make artifacts: exports and derived stages
                p = made_by(n)
                rows.append(self._row(PlannedArtifact(p.artifact, p.quant, n, tuple(evaluators.get(p.artifact, ())))))
        return rows

    def _row(self, a: PlannedArtifact) -> BuiltArtifact:
        made = self.outcomes[a.maker.id]
        out = made.output
        publish = self.outcomes.get(f"publish/{a.name}")
        where: dict[str, Any] = {  # what every row has
            "artifact": a.name,
            "quant": a.quant,
            "export": made.status,
            "path": str(out.files_dir) if out else None,
            "size": sum(f.size for f in out.files) if out else None,
            "published": publish.status if publish else None,
        }
        if not a.evaluators:  # kiln does not evaluate it (an engine): its runtime's runner does
            record = out.record(ArtifactRecord) if out else None
            return BuiltArtifact(
                **where,
                eval="deferred" if made.status == "deferred" else "not_evaluated",
                metrics=None,
                failures=[],
                reason=made.reason or None,
                runner=made.details.get("runner"),
                command=maker.commands if isinstance(maker := made_by(a.maker), DerivedParams) else None,
                runtime=record.runtime_name if record else None,
            )
        evals = [self._eval(n) for n in a.evaluators]
        statuses = {e.status for e in evals}
        first = evals[0]
        return BuiltArtifact(
            **where,
            # Failed if any runtime failed it, passed if any passed (as the registry judges an artifact).
            eval="failed" if "failed" in statuses else "passed" if "passed" in statuses else first.status,
            metrics=first.metrics,
            failures=[f if e is first else f"{e.runtime}: {f}" for e in evals for f in e.failures],
            reason=first.reason,
            evals=evals,
        )

    def _eval(self, node: Node) -> RuntimeEval:
        """One runtime's eval of an artifact: its status, metrics and failures, or why it did not run."""
        ev = self.outcomes[node.id]
        report = ev.output.record(EvalReport) if ev.output else None
        return RuntimeEval(
            runtime=eval_column(node),
            runtime_version=report.runtime_version if report else None,
            status=report.status if report else ev.status,
            metrics=report.metrics if report else None,
            failures=report.failures if report else [],
            reason=report.reason if report else ev.reason or None,
            seconds=round(ev.seconds, 2),
        )

    @property
    def deferred(self) -> list[DeferredStage]:
        """Every deferred stage: why, and (for work that needs a runner) the runner and the command."""
        return [
            DeferredStage(node=node_id, reason=o.reason, **o.details)
            for node_id, o in self.outcomes.items()
            if o.status == "deferred"
        ]

    @property
    def ignored(self) -> list[IgnoredFile]:
        """Source files ingest left alone (pickles beside SafeTensors, ...), with the reason."""
        ingest = self.outcomes[self.nodes[0].id].output
        return list(ingest.record(IngestRecord).ignored) if ingest else []

    @property
    def failed_gates(self) -> list[str]:
        return [r.artifact for r in self.artifacts() if r.eval == "failed"]

    def summary(self) -> BuildSummary:
        counts: dict[Status, int] = {}
        for o in self.outcomes.values():
            counts[o.status] = counts.get(o.status, 0) + 1
        artifacts = self.artifacts()
        return BuildSummary(
            model=self.recipe.model,
            version=self.recipe.version,
            stages=counts,
            artifacts=artifacts,
            failed_gates=[r.artifact for r in artifacts if r.eval == "failed"],
            deferred=self.deferred,
            ignored=self.ignored,
            stage_seconds={n: round(o.seconds, 2) for n, o in self.outcomes.items() if o.status in ("built", "ran")},
        )


def stage_externals(recipe: Recipe, store: StageStore) -> None:
    """Put the recipe's files outside the graph (held-out and calibration texts) into the store by digest."""
    hashes = HashCache(store.local.root / HASH_CACHE)
    for path in {recipe.eval_text, recipe.calibration_text}:
        store.put_external(path, hashes.sha256(path))
    hashes.save()


@dataclass(frozen=True)
class ExecutorChoice:
    """Which executor runs the graph: `local` (this process) or `ray` (a cluster, at `ray_address`)."""

    name: Literal["local", "ray"] = "local"
    store_url: str | None = None  # the shared store's URL, for executors whose workers open it themselves
    ray_address: str | None = None
    max_retries: int = 3


def run(
    recipe: Recipe,
    store: StageStore,
    *,
    registry: str | None = None,
    reporter: Reporter | None = None,
    executor: ExecutorChoice | None = None,
    device: str | Device = "cpu",
    force: bool = False,
    machine: Machine | None = None,
) -> BuildResult:
    """Plan the recipe and run its graph; a stage that failed (after what did not depend on it ran, with
    the Ray executor) is raised once every other outcome is known.

    Before anything runs, a local build whose stages would write more than the work dir's disk has free
    (`machine`, this one by default) is refused (BUILD_DISK_INSUFFICIENT) unless `force`.

    `device` (`auto`, `cpu`, `cuda`, `cuda:N`, or a `Device`) is where the compute stages run: checked
    against this machine for the local executor (DEVICE_UNAVAILABLE when it lacks it), against the
    cluster for Ray (whose `auto` is a GPU when some node offers one, and whose GPU stages wait, deferred,
    when none does)."""
    refuse_shape_only(recipe)
    executor = executor or ExecutorChoice()
    if executor.name == "ray":
        from kiln.pipeline.executors.ray import RayExecutor

        ray_executor = RayExecutor(
            store,
            executor.store_url,
            address=executor.ray_address,
            reporter=reporter,
            max_retries=executor.max_retries,
        )
        nodes = plan(recipe, store, registry=registry, device=ray_executor.placement(device))
        stage_externals(recipe, store)
        outcomes = ray_executor.run(nodes)
    else:
        nodes, sizing = _plan(recipe, store, registry=registry, device=resolve_device(device))
        if not force:
            refuse_full_disk(nodes, sizing, store, machine or this_machine(store.local.root))
        stage_externals(recipe, store)
        outcomes = LocalExecutor(store, reporter).run(nodes)
    result = BuildResult(recipe, nodes, outcomes)
    failed = [o for o in outcomes.values() if o.status == "failed"]
    if failed:
        # The first failure, as its stage raised it (so the exit code is the same as a local build's),
        # with every other failure and what was cancelled because of them.
        error = failed[0].error or StageFailed(f"{failed[0].node.id} failed: {failed[0].reason}")
        error.details.setdefault("stage", failed[0].node.id)
        error.details["failed"] = {o.node.id: o.reason for o in failed}
        error.details["cancelled"] = {o.node.id: o.reason for o in outcomes.values() if o.status == "cancelled"}
        raise error
    return result


def run_one(
    recipe: Recipe,
    store: StageStore,
    stage_id: str,
    *,
    registry: str | None = None,
    reporter: Reporter | None = None,
    device: str | Device = "cpu",
) -> NodeOutcome:
    """Run one stage of the recipe's graph from the store (the unit a CI job runs): every input must be
    there already, made by any machine; a missing one is an error naming it and its key. Its inputs are
    the outputs of the graph placed on `device` too (a GPU job reads the GPU reference)."""
    refuse_shape_only(recipe)
    nodes = plan(recipe, store, registry=registry, device=resolve_device(device))
    by_id = {n.id: n for n in nodes}
    if stage_id not in by_id:
        raise UnknownName(
            f"the recipe has no stage {stage_id!r}; it has: {', '.join(by_id)}", details={"known": list(by_id)}
        )
    node = by_id[stage_id]
    done = stored(nodes[: nodes.index(node)], store)
    inputs = {}
    for role, input_id in node.inputs.items():
        have = done[input_id]
        if have.key is None or have.digest is None:
            what = f"key {have.key}" if have.key else "its own inputs are not in the store either"
            raise StageInputMissing(
                f"{stage_id} needs {input_id} ({what}), which is not in the store: run it first",
                details={"stage": stage_id, "missing": input_id, "key": have.key},
            )
        inputs[role] = require_input(store, by_id[input_id], have.key)
    stage_externals(recipe, store)
    outcome = run_node(store, node, inputs, reporter, where=_where_ci)
    if reporter is not None:
        reporter.finish(outcome)
    return outcome


def _where_ci() -> dict[str, Any]:
    """Where `kiln run-stage` ran: the host, and the CI runner and run when it is a GitHub Actions job."""
    import os
    import socket

    ci = {k.lower(): os.environ[k] for k in ("RUNNER_NAME", "GITHUB_RUN_ID", "GITHUB_JOB") if os.environ.get(k)}
    return {"executor": "run-stage", "host": socket.gethostname(), **ci}


def status(
    recipe: Recipe, store: StageStore, *, device: Device = CPU, gpu: str | None = None, machine: Machine | None = None
) -> list[PlanRow]:
    """What `kiln plan` shows: each node, what it needs on `device` (sized for the catalog's `gpu`, or this
    machine's), its cache key, and whether its output is stored (`shape only`: a source that has none); the disk it
    reads and writes and its estimated seconds (`placement.cost`); and, for a node still to build, what of
    `machine` (this one by default) it would not fit (`misfits`: memory, or the disk with the stages before it),
    with the numbers and what would make it fit. Nothing is hashed (`plan`'s `hash_source`)."""
    nodes, sizing = _plan(recipe, store, device=device, gpu=gpu, hash_source=False)
    machine = machine or this_machine(store.local.root)
    work = stage_costs(nodes, sizing)
    done = stored(nodes, store)
    deferred: set[str] = set()
    written = 0  # what the stages to build before this one leave on disk
    rows = []
    for node in nodes:
        key = done[node.id].key
        state: PlanState = "cached" if done[node.id].digest is not None else "to build"
        extra: dict[str, Any] = {}  # the row's reason, or what the stage's deferral says
        # A stage this machine cannot run is deferred to a runner (and so is everything that waits on it).
        blocked = [i for i in node.inputs.values() if i in deferred]
        needs = node.stage.deferral(node) if node.stage.deferral is not None and state != "cached" else None
        if needs is not None:
            state, extra = "deferred", needs
        elif blocked:
            state, extra = "deferred", {"reason": f"waits on {', '.join(blocked)}"}
        if state == "deferred":
            deferred.add(node.id)
        unhashed = node.args.get("unhashed")
        if unhashed:  # planned from headers: the source is hashed when a build ingests it
            key, extra = None, {"reason": f"not hashed yet ({', '.join(unhashed)}): hashed once, at ingest"}
        if recipe.is_shape_only:
            state = "shape only"
        cost, rates = work[node.id], _rates(node, sizing)
        misfits = Misfits()
        if state in ("to build", "shape only"):
            misfits = _misfits(node, sizing, machine, cost, written)
            written += cost.written_bytes
        timing = _timing(node, cost, rates)
        rows.append(
            PlanRow(
                node=node.id,
                stage=node.stage.name,
                inputs=node.inputs,
                key=key,
                state=state,
                requires=node.requires,
                disk=DiskUse(
                    read_bytes=cost.read_bytes, written_bytes=cost.written_bytes, scratch_bytes=cost.scratch_bytes
                ),
                flops=cost.flops,
                kind=timing.kind,
                seconds=timing.seconds,
                timed=timing.timed,
                floor_seconds=timing.floor_seconds,
                rates=rates.basis if rates is not None else None,
                misfits=misfits,
                **extra,
            )
        )
    return rows


class _Timing(NamedTuple):
    """A plan row's time: `seconds`, the estimate on the node's device (`placement.cost.estimate`) for its `kind` of
    work, `timed` whether that kind was measured there (else it is the floor), and `floor_seconds`."""

    kind: str
    seconds: float | None
    timed: bool
    floor_seconds: float | None


def _timing(node: Node, cost: StageWork, rates: Rates | None) -> _Timing:
    """A plan row's time; no seconds on a device of unknown kind."""
    kind = stage_kind(node)
    if rates is None:
        return _Timing(kind, None, False, None)
    estimated, timed = estimate(cost, rates, kind)
    return _Timing(kind, round(estimated, 1), timed, round(seconds(cost, rates), 1))


def _misfits(node: Node, sizing: Sizing, machine: Machine, cost: StageWork, before: int) -> Misfits:
    """What of `machine` a node to build would not fit: host memory beyond what its stages may use (with a catalog GPU
    that would hold it, for a node that can compute on one), a GPU it was sized for that is too small, the disk
    once the stages before it (`before` bytes) have written theirs."""
    req = node.requires
    memory = device = disk = None
    if req.memory_bytes > machine.memory_bytes:
        memory = MemoryMisfit(
            needed_bytes=req.memory_bytes,
            memory_bytes=machine.memory_bytes,
            fix=_memory_fix(node, sizing, machine),
        )
    if not req.fits:
        device = DeviceMisfit(
            needed_bytes=req.device_memory_bytes, gpus=req.gpus, fix=_memory_fix(node, sizing, machine)
        )
    need = before + cost.disk_peak_bytes
    if cost.disk_peak_bytes and need > machine.disk_free_bytes:
        disk = DiskMisfit(
            needed_bytes=need,
            free_bytes=machine.disk_free_bytes,
            fix=f"free {(need - machine.disk_free_bytes) / 1e9:.1f} GB more, or build fewer targets at a time",
        )
    return Misfits(memory=memory, device=device, disk=disk)


def _memory_fix(node: Node, sizing: Sizing, machine: Machine) -> str:
    """What would hold `node`: the smallest CUDA GPU of the catalog it fits (`--device cuda --gpu SKU`) with the host
    memory it then needs within this machine's, for a node that can compute on one; else a machine with the
    memory it needs."""
    if computes_on_device(node):
        cuda = sorted((p.memory_gib, name) for name, p in PROFILES.items() if p.family == "cuda")
        for _, sku in cuda:
            on_gpu = replace(sizing, device=PlanDevice("cuda", catalog_gpu(sku)))
            req = node.stage.requirements(with_device(node, Device("cuda")), on_gpu)
            if req.fits and req.memory_bytes <= machine.memory_bytes:
                host = req.memory_bytes / 2**30
                return f"--device cuda --gpu {sku}: {req.gpus or 1} x {sku}, {host:.1f} GiB of host memory"
    return f"a machine with {node.requires.memory_bytes / 2**30:.1f} GiB of memory"


def matrix(recipe: Recipe, store: StageStore, *, device: Device = CPU, gpu: str | None = None) -> Matrix:
    """The graph for a CI workflow: its stages by level (a stage's inputs are all in earlier levels), each
    with the runner labels its requirements need (the recipe's `runners:` first, then
    `pipeline.requirements.RUNNER_LABELS`), and the same stages grouped by runner labels.

    Each level is a GitHub Actions matrix (`{"include": [...]}`): its jobs may run in parallel, each
    `kiln run-stage RECIPE STAGE` on a runner with those labels. Publishing is its own job after them.
    The compute stages are placed on `device` (a plan sized for the catalog's `gpu` asks for its runners)."""
    nodes = plan(recipe, store, device=device, gpu=gpu, hash_source=False)
    depth: dict[str, int] = {}
    levels: list[list[MatrixEntry]] = []
    by_runner: dict[str, list[str]] = {}
    for node in nodes:
        depth[node.id] = 1 + max((depth[i] for i in node.inputs.values()), default=-1)
        labels = runner_labels(node.requires, recipe.runners)
        entry = MatrixEntry(
            stage=node.id,
            runs_on=labels,
            accelerator=node.requires.accelerator,
            runtime_env=node.requires.runtime_env,
        )
        while len(levels) <= depth[node.id]:
            levels.append([])
        levels[depth[node.id]].append(entry)
        by_runner.setdefault(",".join(labels), []).append(node.id)
    return Matrix(
        model=recipe.model,
        version=recipe.version,
        levels=[MatrixLevel(include=level) for level in levels],
        by_runner=by_runner,
    )
