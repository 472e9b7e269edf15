"""Signed artifacts: Sigstore bundles holding a DSSE envelope over an in-toto statement, verified offline.

Two statements are signed per artifact, both as a Sigstore bundle (media type
`application/vnd.dev.sigstore.bundle.v0.3+json`) with a publisher's elliptic-curve key:

- the signature: the OpenSSF model signing format (predicate `https://model_signing/signature/v1.0`),
  one sha256 per file of the artifact. `pipeline.signing` makes it with the `model-signing` package;
  `model_signing.verifying` accepts it, and this module verifies it without that package.
- the provenance: a SLSA v1 provenance predicate whose subjects are the artifact's files.

Verification here needs only `cryptography` and the bytes: the registry checks an upload against the
keys it trusts for the model, `kiln verify` a downloaded directory. Sources: DSSE v1 (PAE),
github.com/secure-systems-lab/dsse/blob/master/protocol.md; Sigstore bundle v0.3,
github.com/sigstore/protobuf-specs; model signing v1.0 predicate, github.com/sigstore/model-transparency.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from core.digest import canonical_json, sha256_file
from core.errors import DigestMismatch, InvalidInput

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
IN_TOTO_STATEMENT_V1 = "https://in-toto.io/Statement/v1"
MODEL_SIGNATURE_PREDICATE = "https://model_signing/signature/v1.0"
SLSA_PROVENANCE_V1 = "https://slsa.dev/provenance/v1"
# Where a downloaded artifact directory keeps them (model.sig is the model-signing CLI's default name);
# they are never part of the signed files.
SIGNATURE_FILE = "model.sig"
PROVENANCE_FILE = "provenance.sigstore.json"
ATTESTATION_FILES = {"signature": SIGNATURE_FILE, "provenance": PROVENANCE_FILE}
# The curves model-signing signs with, and the hash each is used with (as Sigstore's specs pair them).
CURVE_HASHES: dict[str, type[hashes.HashAlgorithm]] = {
    "secp256r1": hashes.SHA256,
    "secp384r1": hashes.SHA384,
    "secp521r1": hashes.SHA512,
}


class SignatureInvalid(InvalidInput):
    """A signature or provenance bundle that does not verify: malformed, another key's, or altered."""

    code = "SIGNATURE_INVALID"


class KeyInvalid(InvalidInput):
    code = "KEY_INVALID"


def load_public_key(pem: str | bytes) -> ec.EllipticCurvePublicKey:
    """A PEM public key on a supported curve; KEY_INVALID says why not."""
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise KeyInvalid(f"not a PEM public key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in CURVE_HASHES:
        name = key.curve.name if isinstance(key, ec.EllipticCurvePublicKey) else type(key).__name__
        raise KeyInvalid(f"unsupported key {name}: use an elliptic-curve key on {', '.join(CURVE_HASHES)}")
    return key


def load_private_key(path: str | Path, password: str | None = None) -> ec.EllipticCurvePrivateKey:
    """A PEM private key file (optionally encrypted) on a supported curve."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password.encode() if password else None)
    except (ValueError, TypeError, OSError) as exc:
        raise KeyInvalid(f"cannot read the signing key {path}: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in CURVE_HASHES:
        raise KeyInvalid(f"the signing key {path} is not an elliptic-curve key on {', '.join(CURVE_HASHES)}")
    return key


def public_key_pem(key: ec.EllipticCurvePublicKey) -> str:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def key_id(key: ec.EllipticCurvePublicKey) -> str:
    """The id the registry knows a key by: sha256 of its DER SubjectPublicKeyInfo."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def key_hint(key: ec.EllipticCurvePublicKey) -> str:
    """The hint model-signing puts in a bundle: sha256 of the PEM public key."""
    return hashlib.sha256(public_key_pem(key).encode()).hexdigest()


def _pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is actually signed."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def sign_statement(statement: Mapping[str, Any], key: ec.EllipticCurvePrivateKey) -> bytes:
    """A Sigstore bundle (JSON bytes) with a DSSE envelope over `statement`, signed with `key`."""
    payload = canonical_json(dict(statement))
    curve_hash = CURVE_HASHES[key.curve.name]()
    signature = key.sign(_pae(IN_TOTO_PAYLOAD_TYPE, payload), ec.ECDSA(curve_hash))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(key.public_key())}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": IN_TOTO_PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}],
        },
    }
    return json.dumps(bundle, indent=2, sort_keys=True).encode()


@dataclass(frozen=True)
class Envelope:
    """A bundle's parts, parsed but not yet verified."""

    hint: str | None
    payload: bytes
    signature: bytes


def read_bundle(data: bytes) -> Envelope:
    """Parse a Sigstore bundle with a DSSE envelope; SIGNATURE_INVALID for anything else."""
    try:
        bundle = json.loads(data)
        if bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
            raise SignatureInvalid(f"not a Sigstore bundle v0.3 (mediaType {str(bundle.get('mediaType'))[:100]!r})")
        envelope = bundle["dsseEnvelope"]
        if envelope.get("payloadType") != IN_TOTO_PAYLOAD_TYPE:
            raise SignatureInvalid(
                f"the envelope holds {str(envelope.get('payloadType'))[:100]!r}, not an in-toto statement"
            )
        if len(envelope["signatures"]) != 1:
            raise SignatureInvalid(f"expected one signature in the envelope, found {len(envelope['signatures'])}")
        hint = (bundle.get("verificationMaterial") or {}).get("publicKey", {}).get("hint")
        return Envelope(
            hint=str(hint) if hint else None,
            payload=base64.b64decode(envelope["payload"], validate=True),
            signature=base64.b64decode(envelope["signatures"][0]["sig"], validate=True),
        )
    except SignatureInvalid:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise SignatureInvalid(f"malformed Sigstore bundle: {type(exc).__name__}: {str(exc)[:200]}") from None


def signed_by(envelope: Envelope, key: ec.EllipticCurvePublicKey) -> bool:
    """True when `key` made the envelope's signature."""
    if envelope.hint is not None and envelope.hint != key_hint(key):
        return False
    try:
        key.verify(
            envelope.signature, _pae(IN_TOTO_PAYLOAD_TYPE, envelope.payload), ec.ECDSA(CURVE_HASHES[key.curve.name]())
        )
    except InvalidSignature:
        return False
    return True


def verify_bundle(data: bytes, key: ec.EllipticCurvePublicKey, predicate_type: str) -> dict[str, Any]:
    """The in-toto statement of a bundle signed by `key` with `predicate_type`; SIGNATURE_INVALID otherwise."""
    envelope = read_bundle(data)
    if not signed_by(envelope, key):
        raise SignatureInvalid(f"the bundle is not signed by key {key_id(key)[:16]}… (or was altered)")
    return statement_of(envelope, predicate_type)


def statement_of(envelope: Envelope, predicate_type: str) -> dict[str, Any]:
    try:
        statement = json.loads(envelope.payload)
    except ValueError:
        raise SignatureInvalid("the signed payload is not JSON") from None
    if not isinstance(statement, dict) or statement.get("_type") != IN_TOTO_STATEMENT_V1:
        raise SignatureInvalid("the signed payload is not an in-toto v1 statement")
    if statement.get("predicateType") != predicate_type:
        raise SignatureInvalid(
            f"predicateType {str(statement.get('predicateType'))[:100]!r}, expected {predicate_type}"
        )
    return statement


def signed_files(statement: Mapping[str, Any]) -> dict[str, str]:
    """path -> sha256 from a model signing v1.0 statement, its root digest checked."""
    try:
        resources = statement["predicate"]["resources"]
        root = hashlib.sha256()
        files: dict[str, str] = {}
        for r in resources:
            if r["algorithm"] != "sha256":
                raise SignatureInvalid(f"file {r['name']!r} is signed with {r['algorithm']!r}; kiln checks sha256")
            root.update(bytes.fromhex(r["digest"]))
            files[str(r["name"])] = str(r["digest"])
        expected_root = statement["subject"][0]["digest"]["sha256"]
    except SignatureInvalid:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SignatureInvalid(f"malformed model signature statement: {type(exc).__name__}: {exc}") from None
    if root.hexdigest() != expected_root:
        raise SignatureInvalid("the model signature's root digest does not match its files")
    return files


def subject_files(statement: Mapping[str, Any]) -> dict[str, str]:
    """path -> sha256 of an in-toto statement's subjects (the provenance's)."""
    try:
        return {str(s["name"]): str(s["digest"]["sha256"]) for s in statement["subject"]}
    except (KeyError, TypeError) as exc:
        raise SignatureInvalid(f"malformed statement subjects: {type(exc).__name__}: {exc}") from None


def file_differences(signed: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """One line per file whose content differs from what was signed, sorted by path."""
    problems = []
    for path in sorted(set(signed) | set(actual)):
        if path not in actual:
            problems.append(f"file {path}: signed but missing")
        elif path not in signed:
            problems.append(f"file {path}: not signed")
        elif signed[path] != actual[path]:
            problems.append(
                f"file {path}: digest mismatch (signed sha256 {signed[path][:16]}…, found {actual[path][:16]}…)"
            )
    return problems


def check_files(signed: Mapping[str, str], actual: Mapping[str, str], what: str) -> None:
    """DIGEST_MISMATCH naming each file of `what` that differs from the signed digests."""
    problems = file_differences(signed, actual)
    if problems:
        raise DigestMismatch(
            f"{what} does not match its signature: " + "; ".join(problems),
            details={"files": sorted({p.split(":")[0].removeprefix("file ") for p in problems}), "problems": problems},
        )


def directory_files(directory: Path) -> dict[str, str]:
    """path -> sha256 of every file under `directory`, except the attestation files beside them."""
    files = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_file() and rel not in ATTESTATION_FILES.values():
            files[rel] = sha256_file(p)
    return files


@dataclass(frozen=True)
class VerifiedDirectory:
    files: dict[str, str]
    provenance: dict[str, Any] | None


def verify_directory(directory: Path, key: ec.EllipticCurvePublicKey) -> VerifiedDirectory:
    """Check a downloaded artifact offline: its signature (`model.sig`) is `key`'s and its files are exactly
    the signed ones, byte for byte; the provenance beside it, when present, is `key`'s and names them too."""
    signature = directory / SIGNATURE_FILE
    if not signature.is_file():
        raise SignatureInvalid(f"{directory} has no {SIGNATURE_FILE}: nothing to verify against")
    signed = signed_files(verify_bundle(signature.read_bytes(), key, MODEL_SIGNATURE_PREDICATE))
    actual = directory_files(directory)
    check_files(signed, actual, str(directory))
    provenance = None
    if (directory / PROVENANCE_FILE).is_file():
        provenance = verify_bundle((directory / PROVENANCE_FILE).read_bytes(), key, SLSA_PROVENANCE_V1)
        check_files(subject_files(provenance), actual, f"the provenance of {directory}")
    return VerifiedDirectory(files=actual, provenance=provenance)
