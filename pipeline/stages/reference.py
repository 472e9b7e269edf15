"""Reference stage: the source model's logits on the held-out windows, computed once per source and text.

Every eval stage replays these from the stage's output instead of loading the reference model again.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.errors import KilnError
from eval.runtimes import CachedRuntime, TransformersRuntime
from eval.text import EvalText, load_text
from pipeline.records import IngestRecord, ReferenceParams, ReferenceRecord
from pipeline.stage import Stage, StageContext, StageOutput

TEXT_FILE = "heldout.txt"


def eval_text(ingest: StageOutput, text_path: Path, params: ReferenceParams) -> EvalText:
    """The token windows and prompts every runtime is given, from the source's own tokenizer."""
    return load_text(
        ingest.files_dir,
        text_path,
        window=params.window,
        max_tokens=params.max_tokens,
        prompts=params.greedy_prompts,
        greedy_tokens=params.greedy_tokens,
    )


def stored_text(reference: StageOutput, ingest: StageOutput) -> EvalText:
    return eval_text(ingest, reference.files_dir / TEXT_FILE, reference.record(ReferenceRecord).params)


def run(ctx: StageContext) -> ReferenceRecord:
    ingest = ctx.input("ingest")
    source_digest = ingest.record(IngestRecord).source_digest
    params = ReferenceParams.model_validate(ctx.node.params)
    shutil.copyfile(ctx.node.args["text"], ctx.out_dir / TEXT_FILE)
    text = eval_text(ingest, ctx.out_dir / TEXT_FILE, params)
    reference = CachedRuntime(TransformersRuntime(ingest.files_dir), ctx.out_dir, identity=source_digest)
    try:
        for window in text.windows:
            reference.logits(window)
            ctx.progress(len(window), text.tokens + len(text.windows))
        for prompt in text.prompts:
            reference.greedy(prompt, text.greedy_tokens)
    finally:
        reference.close()
    return ReferenceRecord(
        runtime=reference.name,
        version=reference.version,
        source_digest=source_digest,
        text_digest=text.digest,
        params=params,
        windows=len(text.windows),
        tokens=text.tokens,
    )


class StoredReference:
    """The reference as recorded by the reference stage; asking for anything it did not record is a bug."""

    def __init__(self, output: StageOutput):
        self.output = output

    @property
    def name(self) -> str:
        return self.output.record(ReferenceRecord).runtime

    @property
    def version(self) -> str:
        return self.output.record(ReferenceRecord).version

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        raise KilnError("reference logits for these token ids were not recorded", code="REFERENCE_MISSING")

    def greedy(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        raise KilnError("reference continuation for this prompt was not recorded", code="REFERENCE_MISSING")

    def close(self) -> None:
        pass


def stored_reference(output: StageOutput) -> CachedRuntime:
    identity = output.record(ReferenceRecord).source_digest
    return CachedRuntime(StoredReference(output), output.files_dir, identity=identity)


STAGE = Stage(
    "reference", "2", run, ReferenceRecord, "reference logits of the source model (transformers, float32, CPU)"
)
