"""`kiln token create|list|revoke`: registry API tokens."""

from __future__ import annotations

from typing import Annotated

import typer

from client import RegistryClient
from kiln.cli.common import DEFAULT_REGISTRY, JsonOpt, RegistryOpt, answer, emit, token_app
from kiln.console import err, safe_text, stdout


@token_app.command("create")
def token_create(
    name: str,
    scopes: Annotated[str, typer.Option(help="Comma-separated: read, publish, promote, admin.")],
    models: Annotated[str, typer.Option(help="Comma-separated model name patterns (default: all).")] = "",
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Create an API token; its secret is printed once, on stdout."""
    with RegistryClient.connect(registry) as client:
        out = client.create_token(name, [s for s in scopes.split(",") if s], [m for m in models.split(",") if m])
    if as_json:
        emit(out)
        return
    err.print(safe_text(f"token {out['id']} {out['name']!r}: scopes {', '.join(out['scopes'])}; store the secret now"))
    stdout.print(safe_text(out["token"]))


@token_app.command("list")
def token_list(registry: RegistryOpt = DEFAULT_REGISTRY, as_json: JsonOpt = False) -> None:
    """API tokens (never their secrets)."""
    with RegistryClient.connect(registry) as client:
        tokens = client.list_tokens()
    if as_json:
        emit(tokens)
        return
    for t in tokens:
        state = f"revoked {t['revoked_at']}" if t["revoked_at"] else "active"
        models = ", ".join(t["models"]) or "all models"
        stdout.print(
            safe_text(f"{t['id']:>4}  {t['name']:<24} {t['prefix']}…  {','.join(t['scopes']):<22} {models:<20} {state}")
        )


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
    answer(out, as_json, f"token {out['id']} {out['name']!r} revoked")
