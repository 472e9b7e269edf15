"""Real OCI clients against a live registry server: oras (oras-py) pulls an artifact, skopeo reads its
manifest and copies it to a local OCI layout, each with the files' exact bytes; with anonymous reads off,
both log in through the token challenge with a kiln token as the password."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.helpers import serve_in_thread
from tests.registry.test_oci import FILES, MODEL, TAG, _seed

SKOPEO = shutil.which("skopeo")
# CI (.ci/run) installs skopeo and sets KILN_REQUIRE_SKOPEO=1: there the tests run, never skip.
needs_skopeo = pytest.mark.skipif(
    SKOPEO is None and os.environ.get("KILN_REQUIRE_SKOPEO") != "1",
    reason="skopeo is not installed (apt-get install skopeo)",
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def live(app: FastAPI, client: TestClient) -> Iterator[str]:
    _seed(client)
    with serve_in_thread(app) as port:
        yield f"127.0.0.1:{port}"


def _oras_pull(host: str, reference: str, outdir: Path, token: str | None = None) -> list[str]:
    import oras.client

    oras_client = oras.client.OrasClient(hostname=host, insecure=True)
    if token is not None:
        oras_client.auth.set_basic_auth("ci", token)  # not login(): that writes ~/.docker/config.json
    files: list[str] = oras_client.pull(target=f"{host}/{reference}", outdir=str(outdir))
    return files


def _skopeo(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert SKOPEO is not None
    return subprocess.run([SKOPEO, *args], capture_output=True, text=True, timeout=120, env=env, check=False)


def _skopeo_env(tmp_path: Path) -> dict[str, str]:
    # Its own policy (accept anything: this registry's content is checked by digest) and no user auth file.
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    return {**os.environ, "REGISTRY_AUTH_FILE": str(tmp_path / "auth.json"), "HOME": str(tmp_path)}


def _check_layout(layout: Path, tag: str) -> None:
    """The OCI layout skopeo wrote holds the manifest under `tag`, and each file's bytes as a blob."""
    index = json.loads((layout / "index.json").read_text())
    (entry,) = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag]
    manifest = json.loads((layout / "blobs" / "sha256" / entry["digest"].removeprefix("sha256:")).read_bytes())
    titles = {layer["annotations"]["org.opencontainers.image.title"]: layer["digest"] for layer in manifest["layers"]}
    assert titles == {path: f"sha256:{_sha(data)}" for path, data in FILES.items()}
    for path, data in FILES.items():
        assert (layout / "blobs" / "sha256" / _sha(data)).read_bytes() == data, path


def test_oras_pulls_an_artifact_and_its_files_match(live: str, tmp_path: Path) -> None:
    for reference in (f"{MODEL}:{TAG}", f"kiln/{MODEL}:prod-gguf-q4_k_m"):
        outdir = tmp_path / reference.replace("/", "_").replace(":", "_")
        pulled = _oras_pull(live, reference, outdir)
        assert sorted(Path(p).name for p in pulled) == sorted(FILES)
        for path, data in FILES.items():
            assert (outdir / path).read_bytes() == data


@needs_skopeo
def test_skopeo_inspects_and_copies_to_an_oci_layout(live: str, tmp_path: Path) -> None:
    env = _skopeo_env(tmp_path)
    policy = ["--policy", str(tmp_path / "policy.json")]
    inspected = _skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{live}/{MODEL}:{TAG}", env=env)
    assert inspected.returncode == 0, inspected.stderr
    manifest = json.loads(inspected.stdout)
    assert manifest["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    config = _skopeo("inspect", "--config", "--raw", "--tls-verify=false", f"docker://{live}/{MODEL}:{TAG}", env=env)
    assert config.returncode == 0, config.stderr
    assert json.loads(config.stdout)["config"]["quantization"] == "q4_k_m"
    listed = _skopeo("list-tags", "--tls-verify=false", f"docker://{live}/{MODEL}", env=env)
    assert listed.returncode == 0, listed.stderr
    assert TAG in json.loads(listed.stdout)["Tags"]
    layout = tmp_path / "layout"
    copied = _skopeo(
        *policy,
        "copy",
        "--src-tls-verify=false",
        f"docker://{live}/{MODEL}:{TAG}",
        f"oci:{layout}:{TAG}",
        env=env,
    )
    assert copied.returncode == 0, copied.stderr
    _check_layout(layout, TAG)


def test_clients_log_in_through_the_token_challenge(settings: RegistrySettings, tmp_path: Path) -> None:
    app = create_app(settings.model_copy(update={"anonymous_read": False}))
    with TestClient(app, headers={"Authorization": f"Bearer {make_token(app, ['admin'], name='root')}"}) as admin:
        _seed(admin)
    reader = make_token(app, ["read"], models=[MODEL], name="puller")
    try:
        _pull_with_credentials(app, reader, tmp_path)
    finally:
        app.state.engine.dispose()  # served without its lifespan: close the pool here


def _pull_with_credentials(app: FastAPI, reader: str, tmp_path: Path) -> None:
    with serve_in_thread(app) as port:
        host = f"127.0.0.1:{port}"
        outdir = tmp_path / "oras"
        _oras_pull(host, f"{MODEL}:{TAG}", outdir, token=reader)
        assert all((outdir / path).read_bytes() == data for path, data in FILES.items())
        if SKOPEO is None:
            return
        env = _skopeo_env(tmp_path)
        source = f"docker://{host}/{MODEL}:{TAG}"
        refused = _skopeo("inspect", "--raw", "--tls-verify=false", source, env=env)
        assert refused.returncode != 0
        layout = tmp_path / "layout"
        copied = _skopeo(
            "--policy",
            str(tmp_path / "policy.json"),
            "copy",
            "--src-tls-verify=false",
            f"--src-creds=ci:{reader}",
            source,
            f"oci:{layout}:{TAG}",
            env=env,
        )
        assert copied.returncode == 0, copied.stderr
        _check_layout(layout, TAG)
