"""Model cars at `/v2/modelcar/<model>`: an artifact as a container image for KServe, its files under /models.

Through the app on both databases: the image's layers are the base image's, then one tar layer per file
whose bytes are a header, the stored blob and zeros; digests, sizes, ranges and the config's diff ids
agree with the bytes served; layers are hashed once and recorded. The base image is checked when the
registry starts. `test_kserve_runs_the_model_car` copies a model car with skopeo, unpacks it as a
container runtime would and runs KServe's own model-car command in it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import delete, func, select
from starlette.testclient import TestClient

from kiln.core.errors import InvalidInput
from kiln.registry.app import create_app
from kiln.registry.oci.base_image import load_base_image, write_busybox_base
from kiln.registry.oci.modelcar import END_OF_ARCHIVE, MAX_FILE_LAYERS, padding, tar_header
from kiln.registry.oci.models import LayerHashing, TarLayer, TarLayerBlob
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import (
    STAND_IN_EXECUTABLE,
    make_release,
    manifest,
    overwrite_stored_blob,
    post_eval,
    publish,
    seal,
    serve_in_thread,
    upload,
)
from tests.registry.test_oci import CONFIG, FILES, MODEL, TAG, _attest, _seed, manifest_of, oci_error

CAR = f"modelcar/{MODEL}"
IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
BUSYBOX = shutil.which("busybox")
# CI (.ci/run) installs busybox-static and skopeo, runs as root, and sets KILN_REQUIRE_MODELCAR=1.
needs_runtime = pytest.mark.skipif(
    (BUSYBOX is None or shutil.which("skopeo") is None or os.geteuid() != 0)
    and os.environ.get("KILN_REQUIRE_MODELCAR") != "1",
    reason="needs busybox-static, skopeo and root (for unshare and chroot)",
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def base_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base image layout: a real static busybox where there is one, else a stand-in ELF file (the
    registry serves the base's bytes as they are; only the run test needs them to work)."""
    layout = tmp_path_factory.mktemp("base")
    binary = Path(BUSYBOX) if BUSYBOX else layout.parent / "fake-busybox"
    if BUSYBOX is None:
        binary.write_bytes(STAND_IN_EXECUTABLE)
    write_busybox_base(binary, layout)
    return layout


@pytest.fixture
def car_app(settings: RegistrySettings, base_layout: Path) -> Iterator[FastAPI]:
    app = create_app(settings.model_copy(update={"modelcar_base": base_layout}))
    yield app
    app.state.engine.dispose()


@pytest.fixture
def car(car_app: FastAPI) -> Iterator[TestClient]:
    token = make_token(car_app, ["admin"], name="root")
    with TestClient(car_app, headers={"Authorization": f"Bearer {token}"}) as client:
        _seed(client)
        yield client


def _members(layer: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(layer), mode="r:") as tar:
        return {m.name: m for m in tar.getmembers()}


def _blob(client: TestClient, digest: str, name: str = CAR) -> bytes:
    response = client.get(f"/v2/{name}/blobs/{digest}")
    assert response.status_code == 200, response.text[:300]
    assert response.headers["docker-content-digest"] == digest
    assert _sha(response.content) == digest.removeprefix("sha256:")
    return response.content


def test_a_model_car_is_the_base_image_then_one_tar_layer_per_file(car: TestClient, base_layout: Path) -> None:
    manifest, digest = manifest_of(car, TAG, name=CAR)
    base = load_base_image(base_layout)
    assert manifest["config"]["mediaType"] == IMAGE_CONFIG
    assert "artifactType" not in manifest  # a container image, which KServe runs
    assert manifest["layers"][: len(base.layers)] == list(base.layers)
    files = manifest["layers"][len(base.layers) :]
    assert [layer["annotations"]["org.cncf.model.filepath"] for layer in files] == sorted(FILES)
    assert manifest["annotations"]["org.opencontainers.image.base.digest"] == base.manifest_digest
    assert manifest["annotations"]["dev.kiln.artifact"] == "gguf-q4_k_m"
    for layer in files:
        assert layer["mediaType"] == LAYER_TAR
        body = _blob(car, layer["digest"])
        assert len(body) == layer["size"]
        path = layer["annotations"]["org.cncf.model.filepath"]
        members = _members(body)
        assert sorted(members) == ["models", f"models/{path}"]
        info = members[f"models/{path}"]
        assert (info.mode, info.uid, info.gid, info.mtime) == (0o644, 0, 0, 0)
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
            extracted = tar.extractfile(info)
            assert extracted is not None and extracted.read() == FILES[path]
    for layer in base.layers:
        assert _blob(car, layer["digest"]) == base.blob_path(layer["digest"].removeprefix("sha256:")).read_bytes()
    config = json.loads(_blob(car, manifest["config"]["digest"]))
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer["digest"] for layer in manifest["layers"]]}
    assert (config["os"], config["architecture"]) == ("linux", base.config["architecture"])
    assert config["config"]["Cmd"] == ["/bin/sh"]
    # By digest, by channel tag, and HEAD: the same document.
    assert manifest_of(car, digest, name=CAR) == (manifest, digest)
    assert manifest_of(car, "prod-gguf-q4_k_m", name=CAR)[1] == digest
    head = car.head(f"/v2/{CAR}/manifests/{TAG}")
    assert head.status_code == 200 and head.headers["docker-content-digest"] == digest


def test_tar_layers_answer_ranges_across_header_file_and_padding(car: TestClient) -> None:
    manifest, _ = manifest_of(car, TAG, name=CAR)
    (layer,) = [
        x for x in manifest["layers"] if x.get("annotations", {}).get("org.cncf.model.filepath") == "model.gguf"
    ]
    whole = _blob(car, layer["digest"])
    header = len(tar_header("model.gguf", len(FILES["model.gguf"])))
    for first, last in ((0, 10), (header - 5, header + 5), (header + 100, len(whole) - 1), (len(whole) - 1030, None)):
        spec = f"bytes={first}-{'' if last is None else last}"
        response = car.get(f"/v2/{CAR}/blobs/{layer['digest']}", headers={"Range": spec})
        assert response.status_code == 206, spec
        assert response.content == whole[first : None if last is None else last + 1], spec
    past = car.get(f"/v2/{CAR}/blobs/{layer['digest']}", headers={"Range": f"bytes={len(whole)}-"})
    oci_error(past, 416, "UNSUPPORTED")


def _layer_count(app: FastAPI) -> int:
    with app.state.session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(TarLayer)) or 0)


def test_layers_are_hashed_at_seal_or_first_pull_and_kept(car: TestClient, car_app: FastAPI) -> None:
    # Sealing 1.0.0 hashed its files' layers after answering: config.json is the same bytes at the same
    # path in both artifacts, so one layer; 2.0.0 is open, so none of its files.
    assert _layer_count(car_app) == 4
    first, digest = manifest_of(car, TAG, name=CAR)
    with car_app.state.write_session_factory() as session:
        session.execute(delete(TarLayer))
        session.commit()
    # Not recorded (a seal cut short): the first pull by tag hashes them, to the same digests.
    assert manifest_of(car, TAG, name=CAR) == (first, digest)
    assert _layer_count(car_app) == 3
    again = create_app(car_app.state.settings)
    try:
        with TestClient(again) as client:
            client.headers["Authorization"] = f"Bearer {make_token(again, ['read'], name='reader')}"
            assert manifest_of(client, digest, name=CAR) == (first, digest)  # by digest, from the record
    finally:
        again.state.engine.dispose()


def test_gc_deletes_a_collected_blobs_layers(car: TestClient, car_app: FastAPI) -> None:
    from datetime import timedelta

    from kiln.registry.blobs.gc import collect_garbage
    from kiln.registry.blobs.models import Blob

    orphan = upload(car, b"uploaded, never published")
    with car_app.state.write_session_factory() as session:
        member = {"path": "orphan.bin", "sha256": orphan, "size": 25, "header": 1024}
        session.add(
            TarLayer(sha256="f" * 64, members_key="e" * 64, member_count=1, members=[member], size=2048, headers=b"h")
        )
        session.flush()
        session.add(TarLayerBlob(layer_sha256="f" * 64, blob_sha256=orphan))
        session.commit()
    report = collect_garbage(
        car_app.state.write_session_factory, car_app.state.blob_store, car_app.state.blob_references, timedelta(0)
    )
    assert [b.sha256 for b in report.deleted] == [orphan]
    with car_app.state.session_factory() as session:
        assert session.get(Blob, orphan) is None and session.get(TarLayer, "f" * 64) is None
        assert (
            session.scalar(select(func.count()).select_from(TarLayerBlob).where(TarLayerBlob.blob_sha256 == orphan))
            == 0
        )
    assert _layer_count(car_app) == 4  # the published files' stay


def test_a_corrupt_blob_is_refused_not_hashed(car: TestClient, car_app: FastAPI) -> None:
    with car_app.state.write_session_factory() as session:
        session.execute(delete(TarLayer))
        session.commit()
    gguf = FILES["model.gguf"]
    overwrite_stored_blob(car_app.state.blob_store, _sha(gguf), gguf[:-1] + bytes([gguf[-1] ^ 1]))
    response = car.get(f"/v2/{CAR}/manifests/{TAG}")
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "BLOB_CORRUPT" and error["details"]["path"] == "model.gguf"
    overwrite_stored_blob(car_app.state.blob_store, _sha(gguf), gguf[:100])
    assert car.get(f"/v2/{CAR}/manifests/{TAG}").json()["error"]["code"] == "BLOB_CORRUPT"
    with car_app.state.session_factory() as session:
        recorded = session.scalars(select(TarLayer)).all()
    assert "model.gguf" not in {m["path"] for layer in recorded for m in layer.members}


def test_many_files_are_packed_into_bounded_layers(car: TestClient) -> None:
    files = {f"shards/part-{i:04d}.bin": bytes([i % 251]) * (300 + 97 * i) for i in range(MAX_FILE_LAYERS + 57)}
    files["config.json"] = CONFIG
    make_release(car, model=MODEL, version="3.0.0", planned=["orbax-bf16"])
    publish(car, "orbax-bf16", files, ["tpu-v5e"], model=MODEL, version="3.0.0", target="orbax", format="orbax")
    assert post_eval(car, "orbax-bf16", "passed", model=MODEL, version="3.0.0").status_code == 201
    seal(car, model=MODEL, version="3.0.0")
    manifest, _ = manifest_of(car, "3.0.0-orbax-bf16", name=CAR)
    layers = [x for x in manifest["layers"] if x["mediaType"] == LAYER_TAR][1:]  # past the base's
    assert len(layers) == MAX_FILE_LAYERS
    unpacked: dict[str, bytes] = {}
    for layer in layers:
        body = _blob(car, layer["digest"])
        assert len(body) == layer["size"]
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    extracted = tar.extractfile(member)
                    assert extracted is not None
                    unpacked[member.name.removeprefix("models/")] = extracted.read()
    assert unpacked == files
    # A range across two files of one layer: the second's header sits between them.
    packed = next(x for x in layers if "annotations" not in x)
    whole = _blob(car, packed["digest"])
    middle = len(whole) // 2
    response = car.get(f"/v2/{CAR}/blobs/{packed['digest']}", headers={"Range": f"bytes={middle - 700}-{middle + 700}"})
    assert response.status_code == 206 and response.content == whole[middle - 700 : middle + 701]


def test_concurrent_first_pulls_read_each_file_once(car_app: FastAPI, car: TestClient) -> None:
    with car_app.state.write_session_factory() as session:
        session.execute(delete(TarLayer))
        session.commit()
    store = car_app.state.blob_store
    reads: list[str] = []
    original = store.open_range

    def counting(sha256: str, start: int = 0, end: int | None = None) -> Any:
        reads.append(sha256)
        return original(sha256, start, end)

    store.open_range = counting
    token = car.headers["Authorization"]
    with serve_in_thread(car_app) as port:

        def pull(_: int) -> str:
            with httpx.Client(headers={"Authorization": token}) as client:
                response = client.get(f"http://127.0.0.1:{port}/v2/{CAR}/manifests/{TAG}", timeout=60)
            assert response.status_code == 200, response.text
            return response.headers["docker-content-digest"]

        with ThreadPoolExecutor(4) as pool:
            digests = set(pool.map(pull, range(4)))
    assert len(digests) == 1
    assert sorted(reads) == sorted(_sha(data) for data in FILES.values())


def test_a_replica_waits_for_another_ones_hashing(car_app: FastAPI, car: TestClient) -> None:
    """Another replica holds the claim on a layer: a first pull here waits for its record and reads
    nothing; a claim whose replica died (expired) is taken over."""
    from datetime import timedelta

    from kiln.registry.db import utcnow
    from kiln.registry.oci import modelcar

    first, digest = manifest_of(car, TAG, name=CAR)
    with car_app.state.write_session_factory() as session:
        recorded = [modelcar_row_copy(row) for row in session.scalars(select(TarLayer)).all()]
        links = [(link.layer_sha256, link.blob_sha256) for link in session.scalars(select(TarLayerBlob)).all()]
        session.execute(delete(TarLayer))
        for row in recorded:  # every layer claimed by a live replica elsewhere
            session.add(LayerHashing(members_key=row.members_key, holder="other", expires_at=utcnow() + timedelta(60)))
        session.commit()
    store = car_app.state.blob_store
    reads: list[str] = []
    original = store.open_range
    store.open_range = lambda sha256, *a, **k: reads.append(sha256) or original(sha256, *a, **k)

    def other_replica_finishes() -> None:
        time.sleep(1.0)
        with car_app.state.write_session_factory() as session:
            for row in recorded:
                session.add(row)
            session.flush()
            for layer, blob in links:
                session.add(TarLayerBlob(layer_sha256=layer, blob_sha256=blob))
            session.execute(delete(LayerHashing))
            session.commit()

    finisher = threading.Thread(target=other_replica_finishes)
    started = time.monotonic()
    finisher.start()
    assert manifest_of(car, TAG, name=CAR) == (first, digest)
    finisher.join()
    assert time.monotonic() - started >= 0.9 and reads == []
    # A claim that lapsed (its replica died): taken over, hashed here.
    with car_app.state.write_session_factory() as session:
        session.execute(delete(TarLayer))
        for row in recorded:
            session.add(LayerHashing(members_key=row.members_key, holder="dead", expires_at=utcnow() - timedelta(1)))
        session.commit()
    assert manifest_of(car, TAG, name=CAR) == (first, digest)
    assert sorted(reads) == sorted(_sha(data) for data in FILES.values())
    with car_app.state.session_factory() as session:
        # Claims released (the one left is the other artifact's layer, which nobody asked for).
        assert session.scalars(select(LayerHashing.holder)).all() == ["dead"]
    assert modelcar.LEASE_S > modelcar.RENEW_S


def modelcar_row_copy(row: TarLayer) -> TarLayer:
    return TarLayer(
        sha256=row.sha256,
        members_key=row.members_key,
        member_count=row.member_count,
        members=row.members,
        size=row.size,
        headers=row.headers,
    )


def test_a_file_and_a_directory_of_one_name_are_refused_at_publish(car: TestClient) -> None:
    make_release(car, model=MODEL, version="4.0.0", planned=["gguf-q4_k_m"])
    for data in (b"a", b"b"):
        upload(car, data)
    body = manifest("gguf-q4_k_m", {"a": b"a", "a/b": b"b"}, ["cpu"])
    response = car.post(f"/v1/models/{MODEL}/releases/4.0.0/artifacts", json=body)
    assert response.status_code == 422 and "'a' is also a directory of 'a/b'" in response.text


def test_model_car_referrers_and_refusals(car: TestClient, car_app: FastAPI) -> None:
    signature = _attest(car_app, car, "gguf-q4_k_m", "signature", "application/vnd.dev.sigstore.bundle.v0.3+json", b"s")
    _, digest = manifest_of(car, TAG, name=CAR)
    referrers = car.get(f"/v2/{CAR}/referrers/{digest}").json()["manifests"]
    assert [r["artifactType"] for r in referrers] == ["application/vnd.dev.sigstore.bundle.v0.3+json"]
    referrer = car.get(f"/v2/{CAR}/manifests/{referrers[0]['digest']}").json()
    assert referrer["subject"]["digest"] == digest and referrer["layers"][0]["digest"] == f"sha256:{signature}"
    manifest, _ = manifest_of(car, TAG, name=CAR)
    tar_layer = manifest["layers"][-1]["digest"]
    # A tar layer is a blob of the model car repository only.
    oci_error(car.get(f"/v2/{MODEL}/blobs/{tar_layer}"), 404, "BLOB_UNKNOWN")
    oci_error(car.get(f"/v2/{CAR}/manifests/9.9.9-gguf-q4_k_m"), 404, "MANIFEST_UNKNOWN")
    oci_error(car.get("/v2/modelcar/no-such-model/manifests/latest"), 404, "NAME_UNKNOWN")
    oci_error(car.get("/v2/modelcar/x/y/manifests/latest"), 400, "NAME_INVALID")
    # Yanked: its tags, its layers and its manifest by digest are gone.
    assert car.post(f"/v1/models/{MODEL}/releases/1.0.0/yank", json={"reason": "bad"}).status_code == 200
    oci_error(car.get(f"/v2/{CAR}/manifests/{TAG}"), 404, "MANIFEST_UNKNOWN")
    oci_error(car.get(f"/v2/{CAR}/blobs/{tar_layer}"), 404, "BLOB_UNKNOWN")


def test_without_a_base_image_there_are_no_model_cars(seeded_client: TestClient) -> None:
    error = oci_error(seeded_client.get(f"/v2/{CAR}/manifests/{TAG}"), 404, "NAME_UNKNOWN")
    assert "KILN_REGISTRY_MODELCAR_BASE" in error["message"]
    manifest_of(seeded_client, TAG)  # the ModelPack layout is served as before


@pytest.fixture
def seeded_client(client: TestClient) -> TestClient:
    _seed(client)
    return client


def _copy_layout(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _rewrite_json(path: Path, change: Any) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def test_a_bad_base_image_stops_the_registry_with_the_reason(
    settings: RegistrySettings, base_layout: Path, tmp_path: Path
) -> None:
    cases: dict[str, tuple[Path, str]] = {}
    missing = tmp_path / "missing"
    cases["missing"] = (missing, "no index.json")
    corrupt = _copy_layout(base_layout, tmp_path / "corrupt")
    layer = load_base_image(corrupt).layers[0]["digest"].removeprefix("sha256:")
    data = bytearray((corrupt / "blobs" / "sha256" / layer).read_bytes())
    data[-1] ^= 1
    (corrupt / "blobs" / "sha256" / layer).write_bytes(bytes(data))
    cases["corrupt"] = (corrupt, "does not have that digest")
    truncated = _copy_layout(base_layout, tmp_path / "truncated")
    (truncated / "blobs" / "sha256" / layer).write_bytes(b"short")
    cases["truncated"] = (truncated, "missing or not")
    garbage = _copy_layout(base_layout, tmp_path / "garbage")
    (garbage / "index.json").write_text("[1, 2")
    cases["garbage"] = (garbage, "not readable JSON")
    empty = _copy_layout(base_layout, tmp_path / "empty")
    _rewrite_json(empty / "index.json", lambda index: {**index, "manifests": []})
    cases["empty"] = (empty, "no image for linux/amd64")
    hostile = _copy_layout(base_layout, tmp_path / "hostile")
    _rewrite_json(hostile / "index.json", lambda index: {**index, "manifests": [{"digest": "../../etc", "size": 1}]})
    cases["hostile"] = (hostile, "needs a sha256 digest")
    bad_diff = _copy_layout(base_layout, tmp_path / "bad-diff")
    base = load_base_image(bad_diff)
    config = {**base.config, "rootfs": {"type": "layers", "diff_ids": ["sha256:nope"]}}
    config_body = json.dumps(config).encode()
    (bad_diff / "blobs" / "sha256" / _sha(config_body)).write_bytes(config_body)
    manifest_path = bad_diff / "blobs" / "sha256" / base.manifest_digest.removeprefix("sha256:")
    image = json.loads(manifest_path.read_bytes())
    image["config"] = {**image["config"], "digest": f"sha256:{_sha(config_body)}", "size": len(config_body)}
    image_body = json.dumps(image).encode()
    (bad_diff / "blobs" / "sha256" / _sha(image_body)).write_bytes(image_body)
    _rewrite_json(
        bad_diff / "index.json",
        lambda index: {
            **index,
            "manifests": [{**index["manifests"][0], "digest": f"sha256:{_sha(image_body)}", "size": len(image_body)}],
        },
    )
    cases["bad diff ids"] = (bad_diff, "not all sha256 digests")
    nameless = _copy_layout(base_layout, tmp_path / "nameless")
    _rewrite_json(
        nameless / "index.json",
        lambda index: {**index, "manifests": [{**m, "annotations": None} for m in index["manifests"]]},
    )
    assert load_base_image(nameless).name is None  # odd annotations are no name, not a crash
    for case, (layout, reason) in cases.items():
        with pytest.raises(InvalidInput) as raised:
            create_app(settings.model_copy(update={"modelcar_base": layout}))
        assert raised.value.code == "MODELCAR_BASE_INVALID", case
        assert reason in raised.value.message, (case, raised.value.message)
    with pytest.raises(InvalidInput, match=r"no image for linux/arm64 \(it has: linux/amd64\)"):
        load_base_image(base_layout, "linux/arm64")


def test_the_busybox_base_needs_a_static_64_bit_executable(tmp_path: Path) -> None:
    # A program header table of one entry, PT_INTERP: a dynamically linked executable.
    header = bytearray(b"\x7fELF\x02\x01" + bytes(58))
    header[18:20] = (62).to_bytes(2, "little")
    header[32:40] = (64).to_bytes(8, "little")
    header[54:56] = (56).to_bytes(2, "little")
    header[56:58] = (1).to_bytes(2, "little")
    dynamic = tmp_path / "dynamic"
    dynamic.write_bytes(bytes(header) + (3).to_bytes(4, "little") + bytes(52))
    script = tmp_path / "script"
    script.write_bytes(b"#!/bin/sh\necho not a binary\n")
    for binary, reason in ((dynamic, "dynamically linked"), (script, "not a 64-bit ELF")):
        with pytest.raises(InvalidInput, match=reason) as raised:
            write_busybox_base(binary, tmp_path / binary.name)
        assert raised.value.code == "MODELCAR_BASE_INVALID"
    big_endian = bytearray(header)
    big_endian[5] = 2
    big_endian[18:20] = (22).to_bytes(2, "big")
    big_endian[56:58] = bytes(2)  # no program headers: static
    (tmp_path / "s390x").write_bytes(bytes(big_endian))
    write_busybox_base(tmp_path / "s390x", tmp_path / "s390x-layout")
    assert load_base_image(tmp_path / "s390x-layout", "linux/s390x").config["architecture"] == "s390x"


class _Sparse(io.RawIOBase):
    """A seekable stream of `header`, `size` zero bytes (never held in memory) and `trailer`."""

    def __init__(self, header: bytes, size: int, trailer: bytes) -> None:
        self.header, self.size, self.trailer, self.pos = header, size, trailer, 0
        self.total = len(header) + size + len(trailer)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.total + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.total - self.pos)
        h, body_end = len(self.header), len(self.header) + self.size
        out = bytearray(n)
        for i in range(n):  # only headers are read here, a few KiB
            p = self.pos + i
            out[i] = self.header[p] if p < h else (0 if p < body_end else self.trailer[p - body_end])
        buffer[:n] = out
        self.pos += n
        return n


@pytest.mark.parametrize(
    "path",
    ["model-00001-of-00030.safetensors", "tokenizer/ü-vocab.json", "deep/" * 30 + "x.bin"],
)
def test_tar_headers_hold_long_and_unicode_paths_and_files_over_8_gib(path: str) -> None:
    size = 20 * 1024**3 + 7  # past ustar's 8 GiB: the size goes in a PAX record
    header, trailer = tar_header(path, size), bytes(padding(size) + END_OF_ARCHIVE)
    assert (len(header) + size + len(trailer)) % 512 == 0
    with tarfile.open(fileobj=io.BufferedReader(_Sparse(header, size, trailer)), mode="r:") as tar:
        members = tar.getmembers()
    assert members[-1].name == f"models/{path}" and members[-1].size == size
    assert [m.name for m in members[:-1]] == [
        "/".join(["models", *path.split("/")[:i]]) for i in range(len(path.split("/")))
    ]
    assert all(m.isdir() and m.mode == 0o755 for m in members[:-1])
    assert tar_header(path, size) == header  # deterministic


@needs_runtime
def test_kserve_runs_the_model_car(settings: RegistrySettings, base_layout: Path, tmp_path: Path) -> None:
    """skopeo copies the model car from a live registry; its layers are unpacked in order with tar, as a
    container runtime does; KServe's model-car command runs in it (`ln -sf /proc/$$/root/models /mnt/`, in
    its own PID namespace with /proc mounted) and the files behind the link are the published bytes."""
    app = create_app(settings.model_copy(update={"modelcar_base": base_layout}))
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'], name='r')}"}) as admin:
            _seed(admin)
        with serve_in_thread(app) as port:
            layout = tmp_path / "layout"
            policy = tmp_path / "policy.json"
            policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
            env = {**os.environ, "REGISTRY_AUTH_FILE": str(tmp_path / "auth.json"), "HOME": str(tmp_path)}
            source = f"docker://127.0.0.1:{port}/{CAR}:prod-gguf-q4_k_m"
            copy = ["skopeo", "--policy", str(policy), "copy", "--src-tls-verify=false", source, f"oci:{layout}:car"]
            copied = subprocess.run(copy, capture_output=True, text=True, timeout=120, env=env, check=False)
            assert copied.returncode == 0, copied.stderr
    finally:
        app.state.engine.dispose()
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs" / "sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    for layer in manifest["layers"]:
        blob = layout / "blobs" / "sha256" / layer["digest"][7:]
        subprocess.run(["tar", "-xf", str(blob), "-C", str(rootfs)], check=True, timeout=60)
    # KServe's command (`ln -sf /proc/$$/root/models /mnt/ && sleep infinity`), with a look at the files behind
    # the link between the two; it must still be sleeping when `timeout` ends it (exit 124).
    kserve = "ln -sf /proc/$$/root/models /mnt/ && (cd /mnt/models && sha256sum *) && sleep infinity"
    run = f"mount -t proc proc {rootfs}/proc && timeout 2 chroot {rootfs} /bin/sh -c '{kserve}'; [ $? -eq 124 ]"
    result = subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "sh", "-c", run], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    listed = {name: digest for digest, name in (line.split() for line in result.stdout.splitlines())}
    assert listed == {path: _sha(data) for path, data in FILES.items()}
