"""What every command group shares: the app, its options and output helpers.

Exit codes (stable, for CI): 0 ok, else the kind of the error's code (`core.error_codes.Kind`): 1 a stage or
the service failed; 2 bad input (recipe, source, arguments); 3 an eval gate failed; 4 not found; 5 conflict
with what is stored; 6 not allowed; 7 a backend is unavailable.
"""

from __future__ import annotations

import json
import os
import sys
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic_core import to_jsonable_python

from kiln.console import err, safe_text
from kiln.core.error_codes import Kind
from kiln.core.errors import InvalidInput

EXIT_GATE_FAILED = Kind.GATE_FAILED.exit_status
EXIT_INVALID_INPUT = Kind.INVALID.exit_status

app = typer.Typer(
    name="kiln",
    help="Build verified, hardware-specific LLM artifacts from one SafeTensors release, and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Manage the registry database schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
token_app = typer.Typer(help="Manage registry API tokens (needs the admin scope).", no_args_is_help=True)
app.add_typer(token_app, name="token")
runtime_app = typer.Typer(help="Install and list runtime environments (vLLM runs in its own).", no_args_is_help=True)
app.add_typer(runtime_app, name="runtime")
hardware_app = typer.Typer(help="The registry's hardware catalog (changes need the admin scope).", no_args_is_help=True)
app.add_typer(hardware_app, name="hardware")
routing_app = typer.Typer(
    help="Render a channel's routing for the routers people run (Gateway API Inference Extension, KServe).",
    no_args_is_help=True,
)
app.add_typer(routing_app, name="routing")

# Whether the running command was given --json, as parsed (an error is then a JSON document too).
_JSON_REQUESTED: ContextVar[bool] = ContextVar("kiln_json_requested", default=False)


def _record_json(value: bool) -> bool:
    _JSON_REQUESTED.set(bool(value))
    return value


def json_requested() -> bool:
    return _JSON_REQUESTED.get()


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout (for CI).", callback=_record_json)
]
WorkDirOpt = Annotated[
    Path, typer.Option("--work-dir", envvar="KILN_WORK_DIR", help="Content-addressed stage outputs.")
]
RegistryOpt = Annotated[
    str,
    typer.Option(
        "--registry",
        envvar="KILN_REGISTRY",
        help="Registry URL (http://..., token from $KILN_TOKEN), embedded registry directory, or database URL.",
    ),
]
AllowOutsideOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--allow-outside",
        metavar="DIR",
        help="A directory outside the recipe's own that its paths, and symbolic links in its source, may point "
        "into (repeatable; default: $KILN_ALLOW_OUTSIDE, separated by os.pathsep). Never read from the recipe.",
        show_default=False,
    ),
]
StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        envvar="KILN_STORE",
        help="Shared stage store (s3://bucket/prefix) that other machines read and write; --work-dir is then "
        "this machine's copy. Endpoint: $KILN_S3_ENDPOINT_URL or $AWS_ENDPOINT_URL.",
        show_default=False,
    ),
]
ExecutorOpt = Annotated[
    str,
    typer.Option(
        "--executor",
        envvar="KILN_EXECUTOR",
        help="local: every stage in this process; ray: a Ray cluster (--ray-address), each stage on a node "
        "with its resources.",
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        envvar="RAY_ADDRESS",
        help="The Ray cluster (host:port of its head); default: a local cluster for this build.",
        show_default=False,
    ),
]
RetriesOpt = Annotated[
    int,
    typer.Option("--retries", min=0, max=100, help="Ray: times a stage whose worker died is run again."),
]
DEFAULT_WORK = Path(".kiln/work")
DEFAULT_REGISTRY = ".kiln/registry"


def allowed_roots(values: list[Path] | None) -> list[Path]:
    """--allow-outside's directories, else $KILN_ALLOW_OUTSIDE's; each must be an existing directory."""
    env = os.environ.get("KILN_ALLOW_OUTSIDE", "")
    roots = values or [Path(p) for p in env.split(os.pathsep) if p]
    for root in roots:
        if not root.is_dir():
            raise InvalidInput(f"--allow-outside {str(root)!r} is not a directory", details={"dir": str(root)})
    return roots


def emit(data: Any) -> None:
    """`data` as JSON on stdout; a record (or a list of them) as its API writes it, field names and all."""
    plain = to_jsonable_python(data, by_alias=True, inf_nan_mode="strings")
    sys.stdout.write(json.dumps(plain, indent=2, sort_keys=True, default=str) + "\n")


def stamp(at: datetime) -> str:
    """A time as the CLI prints it: ISO 8601 to the second, UTC as `Z`."""
    return at.isoformat(timespec="seconds").replace("+00:00", "Z")


def answer(out: Any, as_json: bool, line: str) -> None:
    """A command's result: `out` as JSON on stdout with --json, else `line` for people on stderr."""
    if as_json:
        emit(out)
    else:
        err.print(safe_text(line))


def fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def split_ref(ref: str) -> tuple[str, str]:
    model, sep, version = ref.partition("@")
    if not sep or not model or not version:
        raise InvalidInput(f"expected MODEL@VERSION, got {ref!r}")
    return model, version
