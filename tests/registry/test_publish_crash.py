"""`kill -9` of `kiln publish` at random moments, against a real server on PostgreSQL: after each kill
nothing half-made is visible (a release is either open, and served by no name, or sealed and
complete), and running the same publish again completes the same release."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from sqlalchemy import Engine

from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from tests.model_factory import make_model
from tests.registry.conftest import _truncate, make_token
from tests.registry.s3_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
ROOT = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("KILN_CRASH_KILLS", "20"))
SEED = int(os.environ.get("KILN_CRASH_SEED", "11"))
RECIPE = """model: crashy
version: "{version}"
source: model
eval:
  text: heldout.txt
  max_tokens: 512
  window: 128
  greedy_prompts: 1
  greedy_tokens: 4
targets:
  - target: gguf
    quants: [f16, q8_0]
  - target: hf-bundle
    quants: [bf16]
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recipe directory with a small generated model and held-out text."""
    root = tmp_path_factory.mktemp("crashy")
    make_model(root / "model")
    shutil.copyfile(ROOT / "examples" / "tiny-llama" / "heldout.txt", root / "heldout.txt")
    return root


@pytest.fixture
def server(postgres_url: str, postgres_engine: Engine, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`kiln serve` on PostgreSQL; yields its URL and an admin token."""
    _truncate(postgres_engine)
    settings = RegistrySettings(database_url=postgres_url, data_dir=tmp_path, blob_url=(tmp_path / "blobs").as_uri())
    app = create_app(settings)
    token = make_token(app, ["admin"], name="crash-admin")
    app.state.engine.dispose()
    port = free_port()
    env = {
        **os.environ,
        "KILN_REGISTRY_DATABASE_URL": postgres_url,
        "KILN_REGISTRY_BLOB_URL": settings.effective_blob_url(),
        "KILN_REGISTRY_DATA_DIR": str(tmp_path),
    }
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                if httpx2.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError("registry did not start: " + (tmp_path / "server.log").read_text())
        yield url, token
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _publish(project: Path, version: str, url: str, token: str, work: Path, log: Path) -> subprocess.Popen[bytes]:
    recipe = project / f"kiln-{version}.yaml"
    recipe.write_text(RECIPE.format(version=version))
    env = {**os.environ, "KILN_TOKEN": token, "KILN_WORK_DIR": str(work)}
    command = [sys.executable, "-m", "kiln", "publish", str(recipe), "--registry", url, "--json"]
    # Its own process group: the kill reaches anything it started.
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)


def _finish(proc: subprocess.Popen[bytes], log: Path) -> None:
    assert proc.wait(900) == 0, log.read_text(errors="replace")


def _check_sealed(detail: dict[str, Any]) -> None:
    assert detail["missing"] == [], detail
    assert all(a["evals"] for a in detail["artifacts"]), detail
    assert sorted(a["name"] for a in detail["artifacts"]) == detail["planned_artifacts"]


def _open_release_is_served(http: httpx2.Client, version: str, detail: dict[str, Any]) -> str | None:
    """What of an open release is reachable by some name, or None when nothing is."""
    promoted = http.post("/v1/models/crashy/channels/staging", json={"version": version})
    if promoted.status_code != 409 or promoted.json()["error"]["code"] != "RELEASE_NOT_SEALED":
        return f"promotion answered {promoted.status_code} {promoted.text}"
    for artifact in detail["artifacts"]:
        hub = http.head(f"/crashy/resolve/{version}%2F{artifact['name']}/model.gguf")
        if hub.status_code != 404:
            return f"the Hub API served {artifact['name']}: {hub.status_code}"
        # Its commit id names content: it may be served, but only from a sealed release holding the same.
        info = http.get(f"/api/models/crashy/revision/{artifact['manifest_digest'][:40]}")
        if info.status_code != 404 and info.json()["kiln"]["version"] == version:
            return f"the Hub API served commit {artifact['manifest_digest'][:40]}"
    return None


def _check_nothing_half_made_is_visible(http: httpx2.Client) -> dict[str, str]:
    """Every release is open (and served by no name) or sealed and complete. Returns version -> status."""
    states = {}
    for release in http.get("/v1/models/crashy/releases").json():
        version, status = release["version"], release["status"]
        detail = http.get(f"/v1/models/crashy/releases/{version}").json()
        if status == "open" and (served := _open_release_is_served(http, version, detail)) is not None:
            # A killed client's last request still runs to its end on the server: a seal sent just
            # before the kill may commit between the listing and these probes. Then, and only then,
            # the release is served, and it must be sealed and complete.
            detail = http.get(f"/v1/models/crashy/releases/{version}").json()
            assert detail["status"] == "sealed", (served, detail)
            status = "sealed"
        states[version] = status
        if status == "sealed":
            _check_sealed(detail)
        else:
            assert status == "open", release
    prod = http.get("/v1/resolve", params={"model": "crashy", "hardware": "cpu"})
    if prod.status_code == 200:
        assert states[prod.json()["version"]] == "sealed"
    return states


def test_publish_killed_at_random_moments_leaves_nothing_half_made(
    project: Path, server: tuple[str, str], tmp_path: Path
) -> None:
    url, token = server
    work, log = tmp_path / "work", tmp_path / "publish.log"
    # A first publish builds every stage (later runs reuse them); a second one times a publish.
    _finish(_publish(project, "0", url, token, work, log), log)
    started = time.monotonic()
    _finish(_publish(project, "00", url, token, work, log), log)
    whole = time.monotonic() - started
    rng = random.Random(SEED)
    killed_at: list[tuple[float, str]] = []
    with httpx2.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        assert _check_nothing_half_made_is_visible(http) == {"0": "sealed", "00": "sealed"}
        for i in range(1, KILLS + 1):
            version = str(i)
            proc = _publish(project, version, url, token, work, log)
            started = time.monotonic()
            if i % 2:  # anywhere in the run, interpreter start-up included
                time.sleep(rng.uniform(0, whole))
            else:  # while the release is open: once it exists, a random moment into the uploads
                while proc.poll() is None and http.get(f"/v1/models/crashy/releases/{version}").status_code == 404:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0, 0.3))
            moment = time.monotonic() - started
            finished = proc.poll() is not None
            if finished:  # it beat the kill: then it must have succeeded
                assert proc.returncode == 0, log.read_text(errors="replace")
            else:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
            states = _check_nothing_half_made_is_visible(http)
            killed_at.append((round(moment, 2), "finished" if finished else states.get(version, "absent")))
            # The same publish again completes the same release.
            _finish(_publish(project, version, url, token, work, log), log)
            assert _check_nothing_half_made_is_visible(http)[version] == "sealed"
            promoted: Any = http.post("/v1/models/crashy/channels/prod", json={"version": version})
            assert promoted.status_code == 200, promoted.text
    # The kills landed at different stages of the publish: before the release existed, while it was
    # open, and after it was sealed (but before the process ended).
    outcomes = {state for _, state in killed_at}
    print(f"publish {whole:.1f}s; kills (seconds, release state after the kill): {killed_at}")
    assert "open" in outcomes, killed_at
