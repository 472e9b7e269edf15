"""Seal stage: once every planned artifact of the release is published with its eval, seal it.

Runs every time after the publish stages (the registry makes it idempotent). Until it has run the
release is open: invisible to resolve, promotion and Hub downloads, so a publish killed half-way
leaves nothing a router or a promotion can see, and the next `kiln publish` completes the same
open release.
"""

from __future__ import annotations

from kiln.client import RegistryClient
from kiln.pipeline.records import SealParams, SealRecord
from kiln.pipeline.stage import Stage, StageContext


def run(ctx: StageContext) -> SealRecord:
    p = SealParams.model_validate(ctx.node.params)
    with RegistryClient.connect(ctx.node.args["registry"]) as client:
        release = client.seal_release(p.model, p.version)
    return SealRecord(model=p.model, version=p.version, status=release.status)


STAGE = Stage(
    "seal",
    "1",
    run,
    SealRecord,
    "seal the release in the registry once all its artifacts are published",
    cacheable=False,
    on_driver=True,
    params=SealParams,
)
