"""Signed artifacts: Sigstore bundles holding a DSSE envelope over an in-toto statement, verified offline.

Two statements are signed per artifact, both as a Sigstore bundle (media type
`application/vnd.dev.sigstore.bundle.v0.3+json`) with a publisher's elliptic-curve key:

- the signature: the OpenSSF model signing format (predicate `https://model_signing/signature/v1.0`),
  one sha256 per file of the artifact, made and verified by the `model-signing` package.
- the provenance: a SLSA v1 provenance predicate whose subjects are the artifact's files.

What binds a signature to an artifact. A signature over file digests alone holds for every artifact
with those files: another model's artifact, another version, another name in the release. So each
signed statement also carries the artifact's claims (`ArtifactClaims`: model, version, artifact name,
target, format, quant, hardware, runtime), inside the signed payload:

- in the model signature, as the manifest's model name (the statement's one subject name, which
  model-signing fills with the directory's name and calls informative; kiln gives it meaning):
  `kiln-artifact/v1:` followed by the claims as canonical JSON. model-signing's verifier returns it
  with the verified manifest, so the claims come out of the same verification as the files;
- in the provenance, as the build's `externalParameters` (the same eight fields).

An attestation holds for an artifact only when its signature verifies, its subjects are exactly the
artifact's files with their digests (ATTESTATION_SUBJECT_MISMATCH otherwise) and every claim equals the
artifact record's (ATTESTATION_CLAIM_MISMATCH, naming the field with the expected and signed values).
A statement without claims (signed before they were bound) is refused: ATTESTATION_CLAIMS_MISSING.

Who parses what. Every bundle, and the statement inside it, is first read by `core.untrusted.loads_json`
(bounded depth, no duplicate keys) and checked for the one shape kiln makes; only then does
model-signing's elliptic-key verifier (`model_signing._signing.sign_ec_key.Verifier`) check the
signature and, for the model signature, rebuild the manifest and its root digest. Its public entry
point (`model_signing.verifying.Config.verify`) is not used because it hashes the model's files from a
local directory: the registry's files are blobs (in S3, say) whose digests were checked on upload, and a
bundle is verified there on its own. The library's verifier reads its key and bundle from files, so they
are written to a temporary directory. What stays hand-written: the strict pre-parse and shape check
above (stricter than the library: one signature, a key hint, canonical base64), comparing the verified
files and claims with the artifact's, and signing the provenance statement (`sign_statement`:
model-signing signs only its own predicate). `tests/core/test_signing_differential.py` runs this module
and model-signing's own verifier on the same genuine and tampered bundles.

Sources: DSSE v1 (PAE), github.com/secure-systems-lab/dsse/blob/master/protocol.md; Sigstore bundle
v0.3, github.com/sigstore/protobuf-specs; model signing v1.0 predicate, github.com/sigstore/model-transparency.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from model_signing._signing import sign_ec_key as ms_ec_key
from model_signing._signing import sign_sigstore_pb as ms_bundle

from kiln.core.digest import canonical_json, same_json
from kiln.core.error_codes import Codes
from kiln.core.errors import DigestMismatch, InvalidInput
from kiln.core.untrusted import InvalidJSON, loads_json, short_repr

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
IN_TOTO_STATEMENT_V1 = "https://in-toto.io/Statement/v1"
MODEL_SIGNATURE_PREDICATE = "https://model_signing/signature/v1.0"
SLSA_PROVENANCE_V1 = "https://slsa.dev/provenance/v1"
# The model signature's subject name: this prefix, then the artifact's claims as canonical JSON.
CLAIMS_NAME_PREFIX = "kiln-artifact/v1:"
# Where a downloaded artifact directory keeps them (model.sig is the model-signing CLI's default name);
# they are never part of the signed files.
SIGNATURE_FILE = "model.sig"
PROVENANCE_FILE = "provenance.sigstore.json"
ATTESTATION_FILES = {"signature": SIGNATURE_FILE, "provenance": PROVENANCE_FILE}
PREDICATES = {"signature": MODEL_SIGNATURE_PREDICATE, "provenance": SLSA_PROVENANCE_V1}
AttestationKind = Literal["signature", "provenance"]
# The curves model-signing signs with, and the hash each is used with (as Sigstore's specs pair them).
CURVE_HASHES: dict[str, type[hashes.HashAlgorithm]] = {
    "secp256r1": hashes.SHA256,
    "secp384r1": hashes.SHA384,
    "secp521r1": hashes.SHA512,
}


class SignatureInvalid(InvalidInput):
    """A signature or provenance bundle that does not verify: malformed, another key's, or altered."""

    code = Codes.SIGNATURE_INVALID


class AttestationSubjectMismatch(SignatureInvalid):
    """A verified statement whose files are not exactly the artifact's."""

    code = Codes.ATTESTATION_SUBJECT_MISMATCH


class AttestationClaimMismatch(SignatureInvalid):
    """A verified statement signed for another artifact (model, version, name, target, quant, ...)."""

    code = Codes.ATTESTATION_CLAIM_MISMATCH


class AttestationClaimsMissing(SignatureInvalid):
    """A verified statement that names no artifact: signed before signatures were bound to one."""

    code = Codes.ATTESTATION_CLAIMS_MISSING


class KeyInvalid(InvalidInput):
    code = Codes.KEY_INVALID


class FileIsSymlink(InvalidInput):
    """A file of a directory being verified is a symbolic link (whatever it points to): refused."""

    code = Codes.FILE_IS_SYMLINK


class NotARegularFile(InvalidInput):
    code = Codes.NOT_A_REGULAR_FILE


# -- keys ---------------------------------------------------------------------------------------


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


# -- claims -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArtifactClaims:
    """What a signed statement says it is about, beside the files: compared field by field with the
    artifact record it is attached to. Hardware is a set (kept sorted)."""

    model: str
    version: str
    artifact: str
    target: str
    format: str
    quant: str
    hardware: tuple[str, ...]
    runtime: Mapping[str, Any]

    FIELDS = ("model", "version", "artifact", "target", "format", "quant", "hardware", "runtime")

    @classmethod
    def of(
        cls,
        *,
        model: str,
        version: str,
        artifact: str,
        target: str,
        format: str,
        quant: str,
        hardware: list[str] | tuple[str, ...],
        runtime: Mapping[str, Any],
    ) -> ArtifactClaims:
        return cls(model, version, artifact, target, format, quant, tuple(sorted(hardware)), dict(runtime))

    def as_dict(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out["hardware"], out["runtime"] = list(self.hardware), dict(self.runtime)
        return out

    def signed_name(self) -> str:
        """The model signature's subject name that carries these claims."""
        return CLAIMS_NAME_PREFIX + canonical_json(self.as_dict()).decode()

    @classmethod
    def from_mapping(cls, data: Any, what: str) -> ArtifactClaims:
        """Claims read from a verified statement; ATTESTATION_CLAIMS_MISSING when any is absent or not
        of its type (a statement signed before claims were bound has none of them)."""
        missing = [f for f in cls.FIELDS if not isinstance(data, Mapping) or f not in data]
        if missing:
            raise AttestationClaimsMissing(
                f"{what} names no artifact (no {', '.join(missing)}): it was signed before kiln bound "
                "signatures to the artifact they sign; sign it again (`kiln publish --signing-key`)",
                details={"missing": missing},
            )
        texts = [f for f in cls.FIELDS[:6] if not isinstance(data[f], str)]
        hardware, runtime = data["hardware"], data["runtime"]
        if texts or not isinstance(hardware, list) or not all(isinstance(h, str) for h in hardware):
            raise AttestationClaimsMissing(f"{what} has malformed claims ({', '.join(texts) or 'hardware'})")
        if not isinstance(runtime, Mapping):
            raise AttestationClaimsMissing(f"{what} has malformed claims (runtime)")
        return cls.of(**{f: data[f] for f in cls.FIELDS})

    @classmethod
    def from_signed_name(cls, name: str, what: str) -> ArtifactClaims:
        if not name.startswith(CLAIMS_NAME_PREFIX):
            raise AttestationClaimsMissing(
                f"{what} names no artifact (its subject is {short_repr(name)}): it was signed before kiln "
                "bound signatures to the artifact they sign; sign it again (`kiln publish --signing-key`)",
                details={"subject": name[:200]},
            )
        return cls.from_mapping(loads_json(name.removeprefix(CLAIMS_NAME_PREFIX), what=f"{what}'s claims"), what)


def check_claims(got: ArtifactClaims, expected: Mapping[str, Any], what: str) -> None:
    """ATTESTATION_CLAIM_MISMATCH unless every field of `expected` (a subset of the claims' fields, as
    `ArtifactClaims.as_dict` writes them) is the signed one, compared as canonical JSON: Python's equality
    would take `true` for `1` and `1.0` for `1`, claims the signer did not make. Names the first field
    that differs."""
    signed = got.as_dict()
    wrong = [f for f in ArtifactClaims.FIELDS if f in expected and not same_json(_normal(f, expected[f]), signed[f])]
    if wrong:
        field = wrong[0]
        raise AttestationClaimMismatch(
            f"{what} was signed for another artifact: {field} {short_repr(signed[field])}, expected "
            f"{short_repr(_normal(field, expected[field]))}",
            details={
                "field": field,
                "expected": _normal(field, expected[field]),
                "got": signed[field],
                "fields": wrong,
            },
        )


def _normal(field: str, value: Any) -> Any:
    return sorted(value) if field == "hardware" else value


# -- bundles ------------------------------------------------------------------------------------


def _pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is actually signed."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def sign_statement(statement: Mapping[str, Any], key: ec.EllipticCurvePrivateKey) -> bytes:
    """A Sigstore bundle (JSON bytes) with a DSSE envelope over `statement`, signed with `key`, in the
    shape model-signing's elliptic-key signer makes (which signs only model-signing's own predicate)."""
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
    """A bundle's parts, strictly parsed but not yet verified."""

    data: bytes
    hint: str
    payload: bytes
    statement: dict[str, Any]


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise SignatureInvalid(f"malformed Sigstore bundle: {what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureInvalid(f"malformed Sigstore bundle: {what} is not canonical base64") from None


def read_bundle(data: bytes) -> Envelope:
    """Parse a Sigstore bundle with a DSSE envelope over an in-toto statement, strictly (INVALID_JSON for
    JSON kiln refuses, deep nesting included; SIGNATURE_INVALID for any other shape). Verifies nothing."""
    bundle = loads_json(data, what="the Sigstore bundle")
    if not isinstance(bundle, dict) or bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        media = bundle.get("mediaType") if isinstance(bundle, dict) else None
        raise SignatureInvalid(f"not a Sigstore bundle v0.3 (mediaType {short_repr(media)})")
    envelope, material = bundle.get("dsseEnvelope"), bundle.get("verificationMaterial")
    if not isinstance(envelope, dict):
        raise SignatureInvalid("malformed Sigstore bundle: no DSSE envelope")
    if envelope.get("payloadType") != IN_TOTO_PAYLOAD_TYPE:
        raise SignatureInvalid(
            f"the envelope holds {short_repr(envelope.get('payloadType'))}, not an in-toto statement"
        )
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or len(signatures) != 1 or not isinstance(signatures[0], dict):
        count = len(signatures) if isinstance(signatures, list) else 0
        raise SignatureInvalid(f"expected one signature in the envelope, found {count}")
    public = material.get("publicKey") if isinstance(material, dict) else None
    hint = public.get("hint") if isinstance(public, dict) else None
    if not isinstance(hint, str) or not hint:
        raise SignatureInvalid("the bundle names no key (verificationMaterial.publicKey.hint)")
    _b64(signatures[0].get("sig"), "the signature")
    payload = _b64(envelope.get("payload"), "the payload")
    try:
        statement = loads_json(payload, what="the signed statement")
    except InvalidJSON as exc:  # inside the envelope: an altered payload, or a signer's bug
        raise SignatureInvalid(exc.message, details=exc.details) from None
    if not isinstance(statement, dict) or statement.get("_type") != IN_TOTO_STATEMENT_V1:
        raise SignatureInvalid("the signed payload is not an in-toto v1 statement")
    return Envelope(data=bytes(data), hint=hint, payload=payload, statement=statement)


def names_key(envelope: Envelope, key: ec.EllipticCurvePublicKey) -> bool:
    """True when the bundle names `key` (its hint); whether `key` signed it is `verify_envelope`'s to say."""
    return envelope.hint == key_hint(key)


@dataclass(frozen=True)
class Attested:
    """A verified attestation: the files it names (path -> sha256) and the artifact it claims to be about."""

    kind: AttestationKind
    files: dict[str, str]
    claims: ArtifactClaims
    statement: dict[str, Any]


# What model-signing's parsers and verifier raise on a bundle that does not verify.
_LIBRARY_REFUSALS = (ValueError, KeyError, TypeError, IndexError, AttributeError, InvalidSignature)


def verify_attestation(data: bytes, key: ec.EllipticCurvePublicKey, kind: AttestationKind) -> Attested:
    """The files and claims of a `kind` bundle signed by `key`; SIGNATURE_INVALID (or INVALID_JSON) if it is
    malformed, another key's or altered, ATTESTATION_CLAIMS_MISSING if it names no artifact."""
    envelope = read_bundle(data)
    if not names_key(envelope, key):
        raise SignatureInvalid(f"the bundle is not signed by key {key_id(key)[:16]}…", details={"kind": kind})
    return verify_envelope(envelope, key, kind)


def verify_envelope(envelope: Envelope, key: ec.EllipticCurvePublicKey, kind: AttestationKind) -> Attested:
    """`verify_attestation` of a bundle already read (`read_bundle`) and found to name `key`."""
    what = f"the {kind}"
    statement = envelope.statement
    if statement.get("predicateType") != PREDICATES[kind]:
        raise SignatureInvalid(
            f"{what} has predicateType {short_repr(statement.get('predicateType'))}, expected {PREDICATES[kind]}"
        )
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        key_path, bundle_path = Path(tmp) / "key.pub", Path(tmp) / "bundle.json"
        key_path.write_text(public_key_pem(key))
        bundle_path.write_bytes(envelope.data)
        try:
            verifier = ms_ec_key.Verifier(key_path)
            signature = ms_bundle.Signature.read(bundle_path)
            if kind == "signature":
                manifest = verifier.verify(signature)
                payload = envelope.payload
            else:  # model-signing's verifier turns only its own predicate into a manifest
                payload_type, payload = verifier._verify_signed_content(signature)
                if payload_type != IN_TOTO_PAYLOAD_TYPE:
                    raise ValueError(f"payload type {payload_type}")
        except _LIBRARY_REFUSALS as exc:
            raise SignatureInvalid(
                f"{what} is not signed by key {key_id(key)[:16]}… or was altered ({type(exc).__name__}: "
                f"{str(exc)[:200]})",
                details={"kind": kind},
            ) from None
    if payload != envelope.payload:  # what was verified is what kiln parsed
        raise SignatureInvalid(f"{what}'s payload reads differently to its verifier")
    if kind == "signature":
        if manifest.serialization_type.get("method") != "files":
            raise SignatureInvalid(f"{what} is not of files (serialization {manifest.serialization_type})")
        files = _resources(statement)
        verified = {rd.identifier: rd.digest.digest_hex for rd in manifest.resource_descriptors()}
        if verified != files:
            raise SignatureInvalid(f"{what}'s files read differently to its verifier")
        claims = ArtifactClaims.from_signed_name(manifest.model_name, what)
    else:
        files = subject_files(statement)
        try:
            parameters = statement["predicate"]["buildDefinition"]["externalParameters"]
        except (KeyError, TypeError):
            parameters = None
        claims = ArtifactClaims.from_mapping(parameters, what)
    return Attested(kind=kind, files=files, claims=claims, statement=statement)


def _resources(statement: Mapping[str, Any]) -> dict[str, str]:
    """path -> sha256 of a model signing v1.0 statement's resources: each once, each sha256."""
    try:
        files: dict[str, str] = {}
        for r in statement["predicate"]["resources"]:
            if r["algorithm"] != "sha256":
                raise SignatureInvalid(f"file {short_repr(r['name'])} is signed with {short_repr(r['algorithm'])}")
            if r["name"] in files:
                raise SignatureInvalid(f"file {short_repr(r['name'])} is signed twice")
            files[str(r["name"])] = str(r["digest"])
    except (KeyError, TypeError) as exc:
        raise SignatureInvalid(f"malformed model signature statement: {type(exc).__name__}: {exc}") from None
    return files


def subject_files(statement: Mapping[str, Any]) -> dict[str, str]:
    """path -> sha256 of an in-toto statement's subjects (the provenance's), each named once."""
    try:
        files = {str(s["name"]): str(s["digest"]["sha256"]) for s in statement["subject"]}
        if len(files) != len(statement["subject"]):
            raise SignatureInvalid("a file is a subject twice")
    except (KeyError, TypeError) as exc:
        raise SignatureInvalid(f"malformed statement subjects: {type(exc).__name__}: {exc}") from None
    return files


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


def check_attested(attested: Attested, expected: Mapping[str, Any], files: Mapping[str, str], what: str) -> None:
    """An attestation holds for an artifact: claims as `expected` (ATTESTATION_CLAIM_MISMATCH) and
    subjects exactly its `files` (ATTESTATION_SUBJECT_MISMATCH, naming each file that differs)."""
    check_claims(attested.claims, expected, f"the {attested.kind} of {what}")
    problems = file_differences(attested.files, files)
    if problems:
        raise AttestationSubjectMismatch(
            f"the {attested.kind} of {what} does not name its files: " + "; ".join(problems),
            details={"kind": attested.kind, "problems": problems},
        )


def check_files(signed: Mapping[str, str], actual: Mapping[str, str], what: str) -> None:
    """DIGEST_MISMATCH naming each file of `what` that differs from the signed digests."""
    problems = file_differences(signed, actual)
    if problems:
        raise DigestMismatch(
            f"{what} does not match its signature: " + "; ".join(problems),
            details={"files": sorted({p.split(":")[0].removeprefix("file ") for p in problems}), "problems": problems},
        )


# -- a downloaded directory ---------------------------------------------------------------------


def _open_regular(path: Path) -> int:
    """A descriptor of `path`, which must be a regular file and not a symbolic link (checked on the
    descriptor itself, so nothing swapped in after a check is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if os.path.islink(path):
            raise FileIsSymlink(
                f"{path} is a symbolic link; kiln verifies only regular files", details={"path": str(path)}
            ) from None
        raise InvalidInput(f"cannot read {path}: {exc.strerror}", details={"path": str(path)}) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotARegularFile(f"{path} is not a regular file", details={"path": str(path)})
    return fd


def _chunks(path: Path) -> Iterator[bytes]:
    with os.fdopen(_open_regular(path), "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file that is not a symbolic link (FILE_IS_SYMLINK, NOT_A_REGULAR_FILE)."""
    return b"".join(_chunks(path))


def directory_files(directory: Path) -> dict[str, str]:
    """path -> sha256 of every file under `directory`, except the attestation files beside them.
    A symbolic link anywhere in it is refused (FILE_IS_SYMLINK), even to identical bytes: what is
    verified is the directory's own files."""
    files = {}
    for root, dirs, names in os.walk(directory):
        for name in sorted(dirs + names):
            path = Path(root) / name
            if path.is_symlink():
                raise FileIsSymlink(
                    f"{path} is a symbolic link; kiln verifies only regular files", details={"path": str(path)}
                )
        for name in sorted(names):
            path = Path(root) / name
            rel = path.relative_to(directory).as_posix()
            if rel in ATTESTATION_FILES.values():
                continue
            digest = hashlib.sha256()
            for chunk in _chunks(path):
                digest.update(chunk)
            files[rel] = digest.hexdigest()
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class VerifiedDirectory:
    files: dict[str, str]
    claims: ArtifactClaims
    provenance: dict[str, Any] | None


def verify_directory(
    directory: Path, key: ec.EllipticCurvePublicKey, expected: Mapping[str, Any] | None = None
) -> VerifiedDirectory:
    """Check a downloaded artifact offline: its signature (`model.sig`) is `key`'s, its files are exactly
    the signed ones, byte for byte (DIGEST_MISMATCH naming each that differs), and its claims are
    `expected`'s (any of `ArtifactClaims.FIELDS`; ATTESTATION_CLAIM_MISMATCH). The provenance beside it,
    when present, is `key`'s, names the same files and claims the same artifact as the signature."""
    files = directory_files(directory)
    signature_path = directory / SIGNATURE_FILE
    if not os.path.lexists(signature_path):
        raise SignatureInvalid(f"{directory} has no {SIGNATURE_FILE}: nothing to verify against")
    signature = verify_attestation(read_regular(signature_path), key, "signature")
    check_claims(signature.claims, expected or {}, f"the signature of {directory}")
    check_files(signature.files, files, str(directory))
    provenance = None
    if os.path.lexists(directory / PROVENANCE_FILE):
        attested = verify_attestation(read_regular(directory / PROVENANCE_FILE), key, "provenance")
        check_claims(attested.claims, signature.claims.as_dict(), f"the provenance of {directory}")
        check_files(attested.files, files, f"the provenance of {directory}")
        provenance = attested.statement
    return VerifiedDirectory(files=files, claims=signature.claims, provenance=provenance)
