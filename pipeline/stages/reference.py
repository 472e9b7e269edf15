"""Reference stage: the source model's logits on the held-out windows, computed once per source and text.

Every eval stage replays these from the stage's output instead of loading the reference model again.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.errors import KilnError
from pipeline.stage import Stage, StageContext, StageOutput

if TYPE_CHECKING:
    from eval.runtimes import CachedRuntime
    from eval.text import EvalText

TEXT_FILE = "heldout.txt"


def eval_text(ingest: StageOutput, text_path: Path, params: dict[str, Any]) -> EvalText:
    """The token windows and prompts every runtime is given, from the source's own tokenizer."""
    from eval.text import load_text

    return load_text(
        ingest.files_dir,
        text_path,
        window=params["window"],
        max_tokens=params["max_tokens"],
        prompts=params["greedy_prompts"],
        greedy_tokens=params["greedy_tokens"],
    )


def stored_text(reference: StageOutput, ingest: StageOutput) -> EvalText:
    return eval_text(ingest, reference.files_dir / TEXT_FILE, reference.result["params"])


def run(ctx: StageContext) -> dict[str, Any]:
    from eval.runtimes import CachedRuntime, TransformersRuntime

    ingest = ctx.input("ingest")
    shutil.copyfile(ctx.node.args["text"], ctx.out_dir / TEXT_FILE)
    text = eval_text(ingest, ctx.out_dir / TEXT_FILE, ctx.node.params)
    reference = CachedRuntime(
        TransformersRuntime(ingest.files_dir), ctx.out_dir, identity=ingest.result["source_digest"]
    )
    try:
        for window in text.windows:
            reference.logits(window)
            ctx.progress(len(window), text.tokens + len(text.windows))
        for prompt in text.prompts:
            reference.greedy(prompt, text.greedy_tokens)
    finally:
        reference.close()
    return {
        "runtime": reference.name,
        "version": reference.version,
        "source_digest": ingest.result["source_digest"],
        "text_digest": text.digest,
        "params": ctx.node.params,
        "windows": len(text.windows),
        "tokens": text.tokens,
    }


class StoredReference:
    """The reference as recorded by the reference stage; asking for anything it did not record is a bug."""

    def __init__(self, output: StageOutput):
        self.output = output

    @property
    def name(self) -> str:
        return str(self.output.result["runtime"])

    @property
    def version(self) -> str:
        return str(self.output.result["version"])

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        raise KilnError("reference logits for these token ids were not recorded", code="REFERENCE_MISSING")

    def greedy(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        raise KilnError("reference continuation for this prompt was not recorded", code="REFERENCE_MISSING")

    def close(self) -> None:
        pass


def stored_reference(output: StageOutput) -> CachedRuntime:
    from eval.runtimes import CachedRuntime

    return CachedRuntime(StoredReference(output), output.files_dir, identity=output.result["source_digest"])


STAGE = Stage("reference", "1", run, "reference logits of the source model (transformers, float32, CPU)")
