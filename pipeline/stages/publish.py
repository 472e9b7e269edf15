"""Publish stage: upload an artifact's blobs, its manifest and its eval result to a registry.

Runs every time (the registry is outside the work dir); the registry makes it idempotent:
blobs already present are skipped, an identical manifest or eval is accepted as is.
"""

from __future__ import annotations

from typing import Any

from kiln import __version__
from kiln.manifest import ArtifactManifest
from pipeline.stage import Stage, StageContext, StageOutput


def manifest_for(export: StageOutput) -> ArtifactManifest:
    r = export.result
    return ArtifactManifest(
        name=r["artifact"],
        target=r["target"],
        format=r["format"],
        quant=r["quant"],
        hardware=r["hardware"],
        unsupported=r.get("unsupported", {}),
        runtime=r["runtime"],
        files=export.files,
        provenance={**export.provenance, "details": r.get("details", {})},
    )


def run(ctx: StageContext) -> dict[str, Any]:
    from registry.client import RegistryClient

    p = ctx.node.params
    stages = {node_id.split("/", 1)[0] for node_id in ctx.inputs}
    # An engine (stage "engine") is published like an export; kiln has no eval of its own for it.
    ingest, export = ctx.input("ingest"), ctx.input("engine" if "engine" in stages else "export")
    evaluation = ctx.input("eval") if "eval" in stages else None
    manifest = manifest_for(export)
    with RegistryClient.connect(ctx.node.args["registry"]) as client:
        client.ensure_model(p["model"], p["description"])
        client.create_release(
            p["model"],
            p["version"],
            source_digest=ingest.result["source_digest"],
            lineage={"source_files": ingest.result["source_files"], "built_by": f"kiln {__version__}"},
            model_config=ingest.result["shape"],
        )
        total = manifest.total_size
        for f in export.files:
            client.upload_blob(export.files_dir / f.path, f.sha256)
            ctx.progress(f.size, total)
        client.publish_artifact(p["model"], p["version"], manifest)
        report = evaluation.result if evaluation is not None else _engine_not_evaluated(export)
        client.post_eval(
            p["model"],
            p["version"],
            manifest.name,
            # A not_evaluated report names the runtime it needs instead of one that ran.
            runtime=report["runtime"] or report["runtime_needed"],
            status=report["status"],
            metrics=report.get("metrics") or {},
            gates=report.get("gate") or {},
            reason="; ".join(report.get("failures") or []) or report.get("reason"),
        )
    return {"artifact": manifest.name, "manifest_digest": manifest.content_digest()}


def _engine_not_evaluated(engine: StageOutput) -> dict[str, Any]:
    sku = engine.result["hardware"][0]
    return {
        "runtime": None,
        "runtime_needed": "tensorrt_llm",
        "status": "not_evaluated",
        "reason": f"kiln does not evaluate engines yet; this one runs under tensorrt_llm on {sku} only",
    }


STAGE = Stage("publish", "1", run, "upload blobs, manifest and eval result to the registry", cacheable=False)
