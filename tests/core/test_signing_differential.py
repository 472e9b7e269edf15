"""kiln's verification of signature and provenance bundles against model-signing's own, on the same bytes.

kiln reads every bundle strictly itself, then has model-signing's elliptic-key verifier check it
(`core.signing`). Here the genuine bundles and tampered copies of them go through both kiln
(`verify_directory`, `verify_attestation`) and model-signing alone: its public verifier, which hashes the
files itself (`model_signing.verifying.Config.verify`), for the model signature; its DSSE verifier for the
provenance, whose predicate its public verifier does not read. Each tampering must be refused by both;
the genuine bundles accepted by both.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from model_signing import verifying as ms_verifying
from model_signing._signing import sign_ec_key as ms_ec_key
from model_signing._signing import sign_sigstore_pb as ms_bundle

from kiln.core.errors import KilnError
from kiln.core.manifest import ArtifactManifest
from kiln.core.signing import (
    IN_TOTO_PAYLOAD_TYPE,
    SIGNATURE_FILE,
    load_public_key,
    verify_attestation,
    verify_directory,
)
from kiln.pipeline.signing import SigningKey, provenance_statement, sign_files, sign_provenance
from tests.pipeline.test_signing import artifact, write_key_pair

Bundle = dict[str, Any]


def _payload(bundle: Bundle) -> Any:
    return json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))


def _set_payload(bundle: Bundle, statement: Any) -> None:
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()


def flip_signature_byte(bundle: Bundle) -> None:
    sig = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[len(sig) // 2] ^= 0x01
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()


def change_payload_type(bundle: Bundle) -> None:
    bundle["dsseEnvelope"]["payloadType"] = "application/json"


def change_media_type(bundle: Bundle) -> None:
    bundle["mediaType"] = "application/vnd.dev.sigstore.bundle+json;version=0.2"


def change_digest(bundle: Bundle) -> None:
    """One file's digest changed, the model signature's root digest recomputed to match."""
    statement = _payload(bundle)
    if "resources" in statement["predicate"]:
        resource = statement["predicate"]["resources"][0]
        resource["digest"] = hashlib.sha256(b"other bytes").hexdigest()
        root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in statement["predicate"]["resources"]))
        statement["subject"][0]["digest"]["sha256"] = root.hexdigest()
    else:
        statement["subject"][0]["digest"]["sha256"] = hashlib.sha256(b"other bytes").hexdigest()
    _set_payload(bundle, statement)


def add_subject(bundle: Bundle) -> None:
    statement = _payload(bundle)
    statement["subject"].append({"name": "extra.bin", "digest": {"sha256": "0" * 64}})
    _set_payload(bundle, statement)


def change_claim(bundle: Bundle) -> None:
    """The claims made for another model, without signing again."""
    statement = _payload(bundle)
    if "resources" in statement["predicate"]:
        statement["subject"][0]["name"] = statement["subject"][0]["name"].replace('"model":"tiny"', '"model":"other"')
    else:
        statement["predicate"]["buildDefinition"]["externalParameters"]["model"] = "other"
    _set_payload(bundle, statement)


def reencode_payload(bundle: Bundle) -> None:
    """The same statement serialized again (other whitespace and key order) and base64-encoded again."""
    statement = _payload(bundle)
    text = json.dumps(statement, indent=1)
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(text.encode()).decode()


def tamper_text(mutate: Callable[[str], str]) -> Callable[[Bundle], str]:
    def tamper(bundle: Bundle) -> str:
        return mutate(json.dumps(bundle, indent=2))

    return tamper


def duplicate_payload_field(text: str) -> str:
    """A second `payload` key after the first, holding another statement: parsers that keep the last see it."""
    bundle = json.loads(text)
    other = base64.b64encode(b'{"_type": "https://in-toto.io/Statement/v1", "subject": []}').decode()
    genuine = json.dumps(bundle["dsseEnvelope"]["payload"])
    return text.replace(f'"payload": {genuine}', f'"payload": {genuine},\n    "payload": "{other}"', 1)


def duplicate_payload_type_field(text: str) -> str:
    return text.replace(
        f'"payloadType": "{IN_TOTO_PAYLOAD_TYPE}"',
        f'"payloadType": "{IN_TOTO_PAYLOAD_TYPE}",\n    "payloadType": "application/json"',
        1,
    )


def deep_nesting(text: str) -> str:
    depth = 200_000
    return text.replace('"tlogEntries": []', '"tlogEntries": ' + "[" * depth + "]" * depth, 1)


TAMPERINGS: dict[str, Callable[[Bundle], str | None]] = {
    "flipped signature byte": flip_signature_byte,
    "changed payload type": change_payload_type,
    "changed media type": change_media_type,
    "changed digest": change_digest,
    "extra subject": add_subject,
    "claims of another model": change_claim,
    "re-encoded payload": reencode_payload,
    "duplicated payload field": tamper_text(duplicate_payload_field),
    "duplicated payloadType field": tamper_text(duplicate_payload_type_field),
    "200,000 nested arrays": tamper_text(deep_nesting),
}


class Signed:
    """An artifact directory, its two bundles (outside it) and the keys, made as `kiln publish` makes them."""

    def __init__(self, root: Path) -> None:
        self.files = root / "artifact"
        self.manifest: ArtifactManifest = artifact(self.files)
        (root / "trusted").mkdir()
        (root / "other").mkdir()
        self.key, self.pub = write_key_pair(root / "trusted")
        self.other_key, _ = write_key_pair(root / "other")
        self.root = root

    def bundles(self, key: SigningKey) -> dict[str, bytes]:
        statement = provenance_statement(
            self.manifest, model="tiny", version="1.0", source_digest="0" * 64, source_files=[], stages={}, evals={}
        )
        return {
            "signature": sign_files(self.files, self.manifest, key, model="tiny", version="1.0"),
            "provenance": sign_provenance(statement, key),
        }


def kiln_accepts(signed: Signed, kind: str, data: bytes) -> bool:
    public = load_public_key(signed.pub.read_bytes())
    try:
        if kind == "signature":
            copy = signed.root / "kiln-copy"
            copy.mkdir(exist_ok=True)
            for f in signed.manifest.files:
                (copy / f.path).parent.mkdir(parents=True, exist_ok=True)
                (copy / f.path).write_bytes((signed.files / f.path).read_bytes())
            (copy / SIGNATURE_FILE).write_bytes(data)
            verify_directory(copy, public, {"model": "tiny", "version": "1.0", "artifact": "gguf-q8"})
        else:
            attested = verify_attestation(data, public, "provenance")
            assert attested.claims.model == "tiny"
    except KilnError:
        return False
    return True


def library_accepts(signed: Signed, kind: str, data: bytes) -> bool:
    path = signed.root / f"library-{kind}.json"
    path.write_bytes(data)
    try:
        if kind == "signature":
            ms_verifying.Config().use_elliptic_key_verifier(public_key=signed.pub).verify(signed.files, path)
        else:
            signature = ms_bundle.Signature.read(path)
            payload_type, payload = ms_ec_key.Verifier(signed.pub)._verify_signed_content(signature)
            statement = json.loads(payload)
            if payload_type != IN_TOTO_PAYLOAD_TYPE:
                return False
            if statement["predicate"]["buildDefinition"]["externalParameters"]["model"] != "tiny":
                return False
    except (ValueError, KeyError, TypeError, IndexError, RecursionError, InvalidSignature):
        return False
    return True


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Signed:
    return Signed(tmp_path_factory.mktemp("differential"))


@pytest.mark.parametrize("kind", ["signature", "provenance"])
def test_genuine_bundles_are_accepted_by_both(signed: Signed, kind: str) -> None:
    data = signed.bundles(signed.key)[kind]
    assert library_accepts(signed, kind, data)
    assert kiln_accepts(signed, kind, data)


@pytest.mark.parametrize("kind", ["signature", "provenance"])
def test_another_keys_bundle_is_refused_by_both(signed: Signed, kind: str) -> None:
    data = signed.bundles(signed.other_key)[kind]
    assert not library_accepts(signed, kind, data)
    assert not kiln_accepts(signed, kind, data)


@pytest.mark.parametrize("kind", ["signature", "provenance"])
@pytest.mark.parametrize("tampering", list(TAMPERINGS))
def test_tampered_bundles_are_refused_by_both(signed: Signed, kind: str, tampering: str) -> None:
    genuine = signed.bundles(signed.key)[kind]
    bundle = json.loads(genuine)
    text = TAMPERINGS[tampering](bundle)
    data = (text if text is not None else json.dumps(bundle, indent=2)).encode()
    assert data != genuine
    assert not library_accepts(signed, kind, data), f"model-signing accepted: {tampering}"
    assert not kiln_accepts(signed, kind, data), f"kiln accepted: {tampering}"


def test_a_changed_file_is_refused_by_both(signed: Signed, tmp_path: Path) -> None:
    data = signed.bundles(signed.key)["signature"]
    path = signed.files / "model.gguf"
    original = path.read_bytes()
    try:
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert not library_accepts(signed, "signature", data)
        assert not kiln_accepts(signed, "signature", data)
    finally:
        path.write_bytes(original)


@pytest.mark.parametrize("kind", ["signature", "provenance"])
def test_kiln_is_stricter_where_the_library_is_lenient(signed: Signed, kind: str) -> None:
    """Bundles model-signing's verifier accepts and kiln refuses: a second signature beside the genuine
    one (the library checks only the first), the same field twice with the genuine value last (the
    library's JSON parser keeps the last), and the signed bytes base64-encoded with line breaks (the
    library's decoder skips characters outside the alphabet). Each still carries the signed bytes, so
    accepting them would be harmless; kiln reads bundles one way only."""
    genuine = signed.bundles(signed.key)[kind]
    two_signatures = json.loads(genuine)
    two_signatures["dsseEnvelope"]["signatures"].append(dict(two_signatures["dsseEnvelope"]["signatures"][0]))
    wrapped = json.loads(genuine)
    payload = wrapped["dsseEnvelope"]["payload"]
    wrapped["dsseEnvelope"]["payload"] = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    duplicated = genuine.decode().replace('"mediaType":', '"mediaType": "x",\n  "mediaType":', 1)
    for data in (json.dumps(two_signatures).encode(), json.dumps(wrapped).encode(), duplicated.encode()):
        assert data != genuine
        assert library_accepts(signed, kind, data)
        assert not kiln_accepts(signed, kind, data)
