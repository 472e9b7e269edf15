"""Small stages for the Ray executor's tests: importable by the cluster's workers (PYTHONPATH has the
repository), each writing a file that names the node it ran on, or failing in a chosen way."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.pipeline.records import Record
from kiln.pipeline.requirements import Requirements
from kiln.pipeline.stage import Node, Stage, StageContext
from tests.memory import new_pages


class ToyRecord(Record):
    value: str
    upstream: list[str]


def _run(ctx: StageContext) -> ToyRecord:
    """Write `out.txt` (this node's value and its inputs' contents); with params `kill_once` (a marker
    path), SIGKILL the worker on the first attempt; with `fail`, raise a kiln error; with `hold_mib`,
    hold that much memory for 0.2 s."""
    upstream = [(ctx.input(role).files_dir / "out.txt").read_text() for role in sorted(ctx.inputs)]
    attempts = ctx.node.params.get("attempts")
    if attempts:
        with open(attempts, "a") as f:
            f.write(f"{os.getpid()}\n")
    marker = ctx.node.params.get("kill_once")
    if marker and not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-stage, as a lost node would
    if ctx.node.params.get("fail"):
        raise InvalidInput(f"{ctx.node.id} refuses its input", code=Codes.SOURCE_INVALID)
    if mib := ctx.node.params.get("hold_mib"):
        with new_pages(int(mib)):  # resident for the 0.2 s it is held
            time.sleep(0.2)
    text = json.dumps({"node": ctx.node.id, "value": ctx.node.params["value"], "upstream": upstream})
    (ctx.out_dir / "out.txt").write_text(text)
    return ToyRecord(value=ctx.node.params["value"], upstream=upstream)


TOY = Stage("toy", "1", _run, ToyRecord, "a test stage")


def toy(
    name: str,
    *,
    inputs: dict[str, str] | None = None,
    accelerator: str | None = None,
    gpus: int = 0,
    **params: object,
) -> Node:
    """A toy node, `toy/<name>`, needing one CPU, `accelerator` (e.g. "nvidia:h100") and `gpus` GPUs."""
    return Node(
        f"toy/{name}",
        TOY,
        params={"value": name, **params},
        inputs=inputs or {},
        requires=Requirements(cpus=1, memory_bytes=0, accelerator=accelerator, gpus=gpus),
    )


def here() -> str:
    return socket.gethostname()
