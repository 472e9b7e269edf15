"""Reference stage: the source model's logits on the held-out windows, computed once per source and text.

The stage tokenises the held-out text once and stores the ids it was cut into (`eval_text.json`) beside
the logits; every eval stage replays both from the stage's output instead of loading the tokenizer and
the reference model again.

It is a compute stage, placed on the build's device (`params["device"]`, `pipeline.placement`): the
model is loaded there and scored one window at a time, each window's logits written to the output as
it comes back to the host.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.errors import KilnError
from eval.runtimes import CachedRuntime, TransformersRuntime
from eval.runtimes.transformers_runtime import TorchDtype
from eval.text import EvalText, load_text
from pipeline.placement import stage_device
from pipeline.records import IngestRecord, ReferenceParams, ReferenceRecord
from pipeline.stage import Stage, StageContext, StageOutput

TEXT_FILE = "heldout.txt"
IDS_FILE = "eval_text.json"  # the token windows and prompts every runtime is given (eval.text.EvalText)
# The reference computes in float32 on every device (on CUDA too: TF32 stays off), so it is the checkpoint's
# weights with as little rounding as the device offers; recorded in its record.
REFERENCE_DTYPE: TorchDtype = "float32"


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


def stored_text(reference: StageOutput) -> EvalText:
    """The token ids the reference stage scored, as it stored them (checked against its record's digest)."""
    data = (reference.files_dir / IDS_FILE).read_bytes()
    return EvalText.from_json(data, digest=reference.record(ReferenceRecord).text_digest)


def run(ctx: StageContext) -> ReferenceRecord:
    ingest = ctx.input("ingest")
    source_digest = ingest.record(IngestRecord).source_digest
    params = ReferenceParams.model_validate(ctx.node.params)
    shutil.copyfile(ctx.external("text"), ctx.out_dir / TEXT_FILE)
    text = eval_text(ingest, ctx.out_dir / TEXT_FILE, params)
    (ctx.out_dir / IDS_FILE).write_text(text.to_json())
    device = stage_device(ctx.node)
    runtime = TransformersRuntime(ingest.files_dir, dtype=REFERENCE_DTYPE, device=device.torch)
    reference = CachedRuntime(runtime, ctx.out_dir, identity=source_digest)
    try:
        for window in text.windows:
            reference.logits(window)
            ctx.progress(len(window), text.tokens + len(text.windows))
        reference.greedy(text.prompts, text.greedy_tokens)
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
        dtype=REFERENCE_DTYPE,
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

    def greedy(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        raise KilnError("reference continuation for this prompt was not recorded", code="REFERENCE_MISSING")

    def close(self) -> None:
        pass


def stored_reference(output: StageOutput) -> CachedRuntime:
    identity = output.record(ReferenceRecord).source_digest
    return CachedRuntime(StoredReference(output), output.files_dir, identity=identity)


STAGE = Stage(
    "reference",
    "3",
    run,
    ReferenceRecord,
    "reference logits of the source model (transformers, float32, on the stage's device)",
)
