"""Prepare stage: work a target needs for every one of its exports of a source, done once.

The gguf target reads the tokenizer as transformers loads it (seconds of imports and loading) here,
once, instead of in each of its exports; its exports take this stage's record as `prepared`.
"""

from __future__ import annotations

from kiln.pipeline.records import PreparedRecord, PrepareParams
from kiln.pipeline.stage import Stage, StageContext
from kiln.pipeline.stages.ingest import open_ingested
from kiln.targets.base import get_target


def run(ctx: StageContext) -> PreparedRecord:
    spec = get_target(PrepareParams.model_validate(ctx.node.params).target)
    assert spec.prepare is not None
    source = open_ingested(ctx.input("ingest"))
    return PreparedRecord(target=spec.name, data=spec.prepare(source))


STAGE = Stage(
    "prepare", "1", run, PreparedRecord, "what a target needs once per source for all its exports", params=PrepareParams
)
