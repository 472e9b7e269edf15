"""Reference stage: the source model's logits on the held-out windows, computed once per source and text.

The stage tokenises the held-out text once and stores the ids it was cut into (`eval_text.json`) beside
the logits; every eval stage replays both from the stage's output instead of loading the tokenizer and
the reference model again.

It is a compute stage, placed on the build's device (`ReferenceParams.device`, `pipeline.placement`). It holds
the model as its plan decided (`node.requires.weights`, `eval.runtimes.residency`): whole where that fits
the memory budget of its device, else streamed by `LayerStream`, one decoder layer at a time over every
window, then the output head one window at a time, keeping resident what the budget allows for its greedy
continuation (decoded on the KV cache, reading only the layers not kept again per token). Its provenance
records the passes over the weights (`resources.weights`). Each window's logits are reduced on the host to the stored
rows of `eval.reference_rows` (most likely tokens, the rest as one mass, with a bound on the KL they
can give) before the next window's are made: at a 128,256-token vocabulary and 4,096 tokens the full
float32 logits would be 2.1 GB per release, the rows at most `max_entries` x 12 bytes per position.

A pre-quantized source's reference is the source as released: computed from its dequantized weights (each FP8
block or MXFP4 tensor dequantized into float32 as its layer is read, `eval.runtimes.layer_stream`), and its
record says so (`dequantized`: the layout), so nothing downstream takes it for a bf16 model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kiln.core.error_codes import Codes
from kiln.core.errors import StageFailed
from kiln.eval.reference_rows import ReferenceStore, reference_rows
from kiln.eval.runtimes.layer_stream import open_transformers
from kiln.eval.runtimes.residency import WHOLE
from kiln.eval.runtimes.transformers_runtime import TorchDtype
from kiln.eval.text import EvalText, load_text
from kiln.pipeline.placement import stage_device
from kiln.pipeline.records import IngestRecord, ReferenceParams, ReferenceRecord
from kiln.pipeline.stage import Stage, StageContext, StageOutput

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
    residency = ctx.node.requires.weights or WHOLE  # a node planned without sizing: the model as transformers loads it
    runtime = open_transformers(ingest.files_dir, REFERENCE_DTYPE, device.torch, residency=residency)
    quantization = ingest.record(IngestRecord).quantization
    dequantized = getattr(runtime, "dequantized", None)
    if dequantized != (quantization.layout if quantization is not None else None):
        runtime.close()
        raise StageFailed(
            f"the ingested source is {quantization.layout if quantization else 'plain'}, but the reference runtime "
            f"read it as {dequantized or 'plain'}",
            code=Codes.REFERENCE_ARCHITECTURE_UNSUPPORTED,
        )
    store = ReferenceStore(ctx.out_dir, identity=source_digest)
    try:
        for window, logits in zip(text.windows, runtime.logits_many(text.windows), strict=True):
            # Row t predicts token t + 1; the last row predicts past the window and is not scored.
            rows = reference_rows(
                logits[:-1],
                window[1:],
                vocab_size=text.vocab_size,
                tail_mass=params.tail_mass,
                max_entries=params.max_entries,
            )
            store.put_rows(window, rows)
            ctx.progress(len(window), text.tokens + len(text.windows))
        for prompt, tokens in zip(text.prompts, runtime.greedy(text.prompts, text.greedy_tokens), strict=True):
            store.put_greedy(prompt, text.greedy_tokens, tokens)
    finally:
        runtime.close()
    return ReferenceRecord(
        runtime=runtime.name,
        version=runtime.version,
        source_digest=source_digest,
        text_digest=text.digest,
        params=params,
        windows=len(text.windows),
        tokens=text.tokens,
        dtype=REFERENCE_DTYPE,
        dequantized=dequantized,
    )


def stored_reference(output: StageOutput) -> ReferenceStore:
    """The reference as the stage stored it; asking for anything it did not store is an error."""
    record = output.record(ReferenceRecord)
    return ReferenceStore(output.files_dir, identity=record.source_digest, name=record.runtime, version=record.version)


STAGE = Stage(
    "reference",
    "5",
    run,
    ReferenceRecord,
    "reference distributions of the source model (transformers, whole or one layer at a time, float32, on the "
    "stage's device)",
    params=ReferenceParams,
)
