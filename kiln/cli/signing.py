"""`kiln verify DIR|MODEL@VERSION/ARTIFACT` and `kiln keys generate|add|list|revoke`: signed artifacts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kiln.cli.common import DEFAULT_REGISTRY, JsonOpt, RegistryOpt, answer, app, emit, split_ref, stamp
from kiln.client import RegistryClient
from kiln.console import err, safe_text, stdout
from kiln.core.datafile import read_data_bytes
from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.signing import (
    PROVENANCE_FILE,
    SignatureInvalid,
    key_id,
    load_public_key,
    public_key_pem,
    verify_directory,
)

keys_app = typer.Typer(
    help="Publisher keys: make a key pair; trust, list and revoke keys (admin).", no_args_is_help=True
)
app.add_typer(keys_app, name="keys")

MAX_KEY_BYTES = 64 * 1024
KeyOpt = Annotated[Path, typer.Option("--key", envvar="KILN_VERIFY_KEY", help="The publisher's PEM public key.")]


@app.command()
def verify(
    target: Annotated[str, typer.Argument(help="a downloaded artifact directory, or MODEL@VERSION/ARTIFACT")],
    key: KeyOpt,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    keep: Annotated[
        Path | None, typer.Option("--download-to", help="With MODEL@VERSION/ARTIFACT: keep the download here.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check offline that an artifact's files are exactly the ones its signature (model.sig) covers, signed
    by KEY, and that its provenance (if present) is KEY's and names them; both must claim the artifact
    (model, version, name, target, quant, hardware, runtime) the registry lists, and no file may be a
    symbolic link. Exit 0 when they are; 2 naming each file that differs, the claim that differs, or
    when the registry downloaded from lists KEY as revoked."""
    public = load_public_key(read_data_bytes(key, "a PEM public key", MAX_KEY_BYTES))
    if Path(target).is_dir():
        _verify(Path(target), public, target, as_json)
        return
    ref, sep, artifact = target.partition("/")
    if not sep or not artifact:
        raise InvalidInput(f"{target!r} is neither a directory nor MODEL@VERSION/ARTIFACT")
    model, version = split_ref(ref)
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        dest = keep or Path(tmp)
        with RegistryClient.connect(registry) as client:
            _check_not_revoked(client, public)
            detail = client.download_artifact(model, version, artifact, dest)
        _verify(dest, public, target, as_json, detail.claims(model=model, version=version))


def _check_not_revoked(client: RegistryClient, public: ec.EllipticCurvePublicKey) -> None:
    """KEY_REVOKED when the registry lists `public` as revoked: what it signed no longer counts."""
    kid = key_id(public)
    for key in client.list_keys():
        if key.key_id == kid and key.revoked_at is not None:
            raise SignatureInvalid(
                f"key {kid} was revoked at {stamp(key.revoked_at)} on the registry: nothing it signed is trusted",
                code=Codes.KEY_REVOKED,
                details={"key_id": kid, "revoked_at": stamp(key.revoked_at)},
            )


def _verify(
    directory: Path, public: ec.EllipticCurvePublicKey, what: str, as_json: bool, expected: dict[str, Any] | None = None
) -> None:
    result = verify_directory(directory, public, expected)
    provenance = "and its provenance " if result.provenance is not None else f"(no {PROVENANCE_FILE}) "
    answer(
        {
            "verified": True,
            "files": len(result.files),
            "key_id": key_id(public),
            "provenance": result.provenance is not None,
            "claims": result.claims.as_dict(),
        },
        as_json,
        f"{what}: {len(result.files)} files match the signature {provenance}of key {key_id(public)[:16]}… "
        f"for {result.claims.model}@{result.claims.version}/{result.claims.artifact}",
    )


@keys_app.command("generate")
def keys_generate(
    path: Annotated[Path, typer.Argument(help="where the private key goes; the public key goes to PATH.pub")],
    curve: Annotated[str, typer.Option(help="p256 or p384")] = "p256",
) -> None:
    """Make an EC key pair for signing (private key unencrypted, mode 0600: keep it in a secret store)."""
    curves: dict[str, ec.EllipticCurve] = {"p256": ec.SECP256R1(), "p384": ec.SECP384R1()}
    if curve not in curves:
        raise InvalidInput(f"unknown curve {curve!r}; known: {', '.join(curves)}")
    if path.exists():
        raise InvalidInput(f"{path} exists; not overwriting a key")
    private = ec.generate_private_key(curves[curve])
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    Path(f"{path}.pub").write_text(public_key_pem(private.public_key()))
    err.print(safe_text(f"wrote {path} and {path}.pub (key id {key_id(private.public_key())})"))


@keys_app.command("add")
def keys_add(
    public_key: Annotated[Path, typer.Argument(help="PEM public key file")],
    model: Annotated[str, typer.Option("--model", help="Model name pattern it signs for (fnmatch), e.g. 'llama-*'.")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Trust a publisher key for models matching a pattern (admin, audited); signatures become required."""
    pem = read_data_bytes(public_key, "a PEM public key", MAX_KEY_BYTES)
    load_public_key(pem)  # refused here, before the registry is asked
    with RegistryClient.connect(registry) as client:
        out = client.add_key(pem.decode("ascii"), model)
    answer(out, as_json, f"key {out.key_id} trusted for {out.model_pattern!r}")


@keys_app.command("list")
def keys_list(registry: RegistryOpt = DEFAULT_REGISTRY, as_json: JsonOpt = False) -> None:
    """Trusted publisher keys, revoked ones included."""
    with RegistryClient.connect(registry) as client:
        keys = client.list_keys()
    if as_json:
        emit(keys)
        return
    for k in keys:
        state = f"revoked {stamp(k.revoked_at)}" if k.revoked_at else "active"
        stdout.print(safe_text(f"{k.key_id}  {k.model_pattern:<24} {k.created_by:<16} {state}"))


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[str, typer.Argument(help="the key id (sha256 of its DER), as `kiln keys list` shows it")],
    reason: Annotated[str | None, typer.Option(help="Why; recorded in the audit log.")] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Revoke a trusted key (admin, audited): nothing it signed counts as signed any more."""
    with RegistryClient.connect(registry) as client:
        out = client.revoke_key(key, reason)
    answer(out, as_json, f"key {out.key_id} revoked")
