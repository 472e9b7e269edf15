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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import func, select
from starlette.testclient import TestClient

from core.errors import InvalidInput
from registry.app import create_app
from registry.oci.base_image import load_base_image, write_busybox_base
from registry.oci.modelcar import tar_header, tar_trailer
from registry.oci.models import TarLayer
from registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import serve_in_thread
from tests.registry.test_oci import FILES, MODEL, TAG, _attest, _seed, manifest_of, oci_error

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
        binary.write_bytes(b"\x7fELF" + bytes(14) + (62).to_bytes(2, "little") + bytes(100))
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


def test_layers_are_hashed_once_and_survive_a_restart(car: TestClient, car_app: FastAPI, base_layout: Path) -> None:
    first, digest = manifest_of(car, TAG, name=CAR)
    manifest_of(car, "1.0.0-hf-bf16", name=CAR)
    with car_app.state.session_factory() as session:
        # config.json is the same bytes at the same path in both artifacts: one layer.
        assert session.scalar(select(func.count()).select_from(TarLayer)) == 4
    again = create_app(car_app.state.settings)
    try:
        with TestClient(again) as client:
            client.headers["Authorization"] = f"Bearer {make_token(again, ['read'], name='reader')}"
            assert manifest_of(client, TAG, name=CAR) == (first, digest)
    finally:
        again.state.engine.dispose()


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
    for case, (layout, reason) in cases.items():
        with pytest.raises(InvalidInput) as raised:
            create_app(settings.model_copy(update={"modelcar_base": layout}))
        assert raised.value.code == "MODELCAR_BASE_INVALID", case
        assert reason in raised.value.message, (case, raised.value.message)
    with pytest.raises(InvalidInput, match=r"no image for linux/arm64 \(it has: linux/amd64\)"):
        load_base_image(base_layout, "linux/arm64")


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
    header, trailer = tar_header(path, size), tar_trailer(size)
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
    kserve = "ln -sf /proc/$$/root/models /mnt/ && cd /mnt/models && sha256sum *"
    run = f"mount -t proc proc {rootfs}/proc && chroot {rootfs} /bin/sh -c '{kserve}'"
    result = subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "sh", "-c", run], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    listed = dict(reversed(line.split()) for line in result.stdout.splitlines())
    assert listed == {path: _sha(data) for path, data in FILES.items()}
