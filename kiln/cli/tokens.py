"""`kiln token create|list|revoke`: registry API tokens."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from typing import Annotated

import typer

from kiln.cli.common import DEFAULT_REGISTRY, JsonOpt, RegistryOpt, answer, emit, stamp, token_app
from kiln.client import RegistryClient
from kiln.console import err, safe_text, stdout
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput

_DURATION = re.compile(r"^([1-9][0-9]{0,5})([hdw])$")
_UNITS = {"h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


def parse_expiry(text: str, now: datetime) -> datetime:
    """`--expires`: a duration from `now` (`12h`, `30d`, `8w`), a date (`2027-01-31`, its start in UTC) or a
    time with its zone (`2027-01-31T12:00:00+00:00`). Anything else: TOKEN_EXPIRY_INVALID."""
    duration = _DURATION.fullmatch(text)
    if duration:
        return now + int(duration[1]) * _UNITS[duration[2]]
    try:
        if re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text):
            return datetime.combine(date.fromisoformat(text), datetime.min.time(), UTC)
        when = datetime.fromisoformat(text)
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise InvalidInput(
            f"--expires {text[:40]!r}: give a duration (12h, 30d, 8w), a date (2027-01-31) or a time with its "
            "zone (2027-01-31T12:00:00+00:00)",
            code=Codes.TOKEN_EXPIRY_INVALID,
        )
    return when


@token_app.command("create")
def token_create(
    name: str,
    scopes: Annotated[str, typer.Option(help="Comma-separated: read, publish, promote, admin.")],
    models: Annotated[str, typer.Option(help="Comma-separated model name patterns (default: all).")] = "",
    expires: Annotated[
        str | None,
        typer.Option(
            help="When it stops working: a duration (12h, 30d, 8w), a date (2027-01-31, UTC) or a time with its "
            "zone; default: the registry's longest token lifetime."
        ),
    ] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Create an API token; its secret is printed once, on stdout."""
    expires_at = None if expires is None else parse_expiry(expires, datetime.now(UTC))
    with RegistryClient.connect(registry) as client:
        out = client.create_token(
            name, [s for s in scopes.split(",") if s], [m for m in models.split(",") if m], expires_at
        )
    if as_json:
        emit(out)
        return
    until = f"expires {stamp(out.expires_at)}" if out.expires_at else "never expires"
    err.print(safe_text(f"token {out.id} {out.name!r}: scopes {', '.join(out.scopes)}; {until}; store the secret now"))
    stdout.print(safe_text(out.token))


@token_app.command("list")
def token_list(registry: RegistryOpt = DEFAULT_REGISTRY, as_json: JsonOpt = False) -> None:
    """API tokens (never their secrets)."""
    with RegistryClient.connect(registry) as client:
        tokens = client.list_tokens()
    if as_json:
        emit(tokens)
        return
    for t in tokens:
        if t.revoked_at:
            state = f"revoked {stamp(t.revoked_at)}"
        elif t.expires_at:
            state = f"{'expired' if t.expires_at <= datetime.now(UTC) else 'expires'} {stamp(t.expires_at)}"
        else:
            state = "active, never expires"
        models = ", ".join(t.models) or "all models"
        stdout.print(safe_text(f"{t.id:>4}  {t.name:<24} {t.prefix}…  {','.join(t.scopes):<22} {models:<20} {state}"))


@token_app.command("revoke")
def token_revoke(
    token_id: int,
    reason: Annotated[str | None, typer.Option(help="Why; recorded in the audit log.")] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Revoke an API token (audited)."""
    with RegistryClient.connect(registry) as client:
        out = client.revoke_token(token_id, reason)
    answer(out, as_json, f"token {out.id} {out.name!r} revoked")
