"""Publish stage: upload an artifact's blobs, its manifest and its eval result to a registry.

Each publish stage opens the release (the same open release for all of them: its content, the
planned artifacts included, is identical) and adds its artifact; the seal stage then seals it.
Runs every time (the registry is outside the work dir); the registry makes it idempotent:
blobs already present are skipped, an identical manifest or eval is accepted as is.

Before anything is uploaded the artifact is linted again by its target's lint (`targets.lint`), against
the ingested source's config: an export made before exports were linted, or one a shared store holds, is
refused (ArtifactLintFailed, naming the tensor) rather than published.

With a signing key ($KILN_SIGNING_KEY, which `kiln publish --signing-key` sets) each artifact is
signed (OpenSSF model signature over its files, naming the artifact's claims) and its SLSA provenance
statement signed with the same key; both are attached to the artifact, and the registry verifies them
against the keys it trusts and the artifact they are attached to.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from kiln.client import RegistryClient
from kiln.core import __version__
from kiln.core.access import AttestationKind
from kiln.core.evals import PublishedEval
from kiln.core.manifest import ArtifactManifest
from kiln.eval.report import EvalReport
from kiln.formats.architectures.shape import ModelShape
from kiln.pipeline.records import ArtifactRecord, IngestRecord, PublishParams, PublishRecord
from kiln.pipeline.signing import SigningKey, provenance_statement, sign_files, sign_provenance
from kiln.pipeline.stage import Stage, StageContext, StageOutput
from kiln.targets.base import get_target
from kiln.targets.lint import LintRequest


def manifest_for(artifact: StageOutput) -> ArtifactManifest:
    """The manifest of an artifact-making stage's output (an export, or a target's derived stage)."""
    r = artifact.record(ArtifactRecord)
    return ArtifactManifest.of(
        r, files=artifact.files, provenance={**artifact.provenance, "details": r.details, **_source_use(r)}
    )


def _source_use(r: ArtifactRecord) -> dict[str, str]:
    """What the artifact holds of a pre-quantized source: the release's own bytes, dequantized tensors (none for a
    plain source's artifact, whose manifest stays as it was)."""
    return {k: v for k, v in (("passed_through", r.passed_through), ("dequantized", r.dequantized)) if v is not None}


def run(ctx: StageContext) -> PublishRecord:
    p = PublishParams.model_validate(ctx.node.params)
    ingest = ctx.record("ingest", IngestRecord)
    artifact = ctx.input("artifact")
    record = artifact.record(ArtifactRecord)
    manifest = manifest_for(artifact)
    lint_artifact(ctx, record, artifact)
    # Each eval under its registry name (`eval@<runtime>`, `eval@tensorrt_llm@<sku>` for a GPU runner's).
    # An artifact without one (an engine built on a GPU runner) is published as not evaluated here.
    reports = {
        role.removeprefix("eval@"): ctx.record(role, EvalReport) for role in ctx.inputs if role.startswith("eval@")
    }
    if not reports:
        reports[record.runtime_name] = EvalReport.not_evaluated(
            record.runtime_name,
            f"kiln does not evaluate {record.format} artifacts yet; this one runs under {record.runtime_name} "
            f"on {', '.join(record.hardware)} only",
        )
    with RegistryClient.connect(ctx.node.args["registry"]) as client:
        client.ensure_model(p.model, p.description)
        client.create_release(
            p.model,
            p.version,
            source_digest=ingest.source_digest,
            planned_artifacts=p.planned,
            lineage={"source_files": [f.model_dump() for f in ingest.source_files], "built_by": f"kiln {__version__}"},
            model_config=ingest.shape.model_dump(mode="json"),
        )
        total = manifest.total_size
        for f in artifact.files:
            client.upload_blob(artifact.files_dir / f.path, f.sha256)
            ctx.progress(f.size, total)
        client.publish_artifact(p.model, p.version, manifest)
        for runtime, each in sorted(reports.items()):
            client.post_eval(p.model, p.version, manifest.name, PublishedEval.of_report(runtime, each))
        key = SigningKey.from_env()
        if key is not None:
            _attach_signed(ctx, client, manifest, ingest, reports, key)
    return PublishRecord(artifact=manifest.name, manifest_digest=manifest.content_digest())


def lint_artifact(ctx: StageContext, record: ArtifactRecord, artifact: StageOutput) -> None:
    """Raise ArtifactLintFailed when the artifact's target lint finds an error in it (nothing is uploaded)."""
    spec = get_target(record.target)
    if spec.lint is None or record.format != spec.format:
        return  # a derived artifact (a TensorRT engine) is not in its target's export format
    config = ctx.input("ingest").files_dir / "config.json"
    shape = ModelShape.from_config(json.loads(config.read_text())) if config.is_file() else None
    spec.lint(LintRequest(artifact.files_dir, shape=shape, quant=record.quant)).raise_for_errors(ctx.node.id)


def _attach_signed(
    ctx: StageContext,
    client: RegistryClient,
    manifest: ArtifactManifest,
    ingest: IngestRecord,
    reports: dict[str, EvalReport],
    key: SigningKey,
) -> None:
    """Sign the artifact's files and its provenance with `key`, and attach both to the artifact."""
    p = PublishParams.model_validate(ctx.node.params)
    statement = provenance_statement(
        manifest,
        model=p.model,
        version=p.version,
        source_digest=ingest.source_digest,
        source_files=[f.model_dump() for f in ingest.source_files],
        stages={output.node_id: output.provenance for output in ctx.inputs.values()},
        evals={runtime: r.model_dump(mode="json", exclude_none=True) for runtime, r in reports.items()},
        recipe_digest=p.recipe_digest,
    )
    bundles: dict[AttestationKind, bytes] = {
        "signature": sign_files(ctx.input("artifact").files_dir, manifest, key, model=p.model, version=p.version),
        "provenance": sign_provenance(statement, key),
    }
    with tempfile.TemporaryDirectory(prefix="kiln-attest-") as tmp:
        for kind, data in bundles.items():
            path = Path(tmp) / kind
            path.write_bytes(data)
            client.attach_attestation(p.model, p.version, manifest.name, kind, path)


STAGE = Stage(
    "publish",
    "2",
    run,
    PublishRecord,
    "upload blobs, manifest and eval result to the registry",
    cacheable=False,
    on_driver=True,
    params=PublishParams,
)
