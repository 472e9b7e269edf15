"""The whole path a user takes: build the example, serve a registry, publish, promote, resolve, download, load."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.registry.helpers import STAND_IN_EXECUTABLE

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny-llama" / "kiln.yaml"
KILN = [sys.executable, "-m", "kiln"]
TEST_KEY = ROOT / "examples" / "tiny-llama" / "signing" / "TEST-ONLY-key.pem"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kiln(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*KILN, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if check and proc.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("work")
    return {**os.environ, "KILN_WORK_DIR": str(work), "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Iterator[str]:
    data = tmp_path_factory.mktemp("registry")
    port = _free_port()
    server_env = {**env, "KILN_REGISTRY_DATA_DIR": str(data)}
    kiln("db", "upgrade", env=server_env)
    # The operator's first admin token, made with direct access to the database; clients use $KILN_TOKEN.
    made = kiln("token", "create", "e2e", "--scopes", "admin", "--registry", str(data), env=env)
    env["KILN_TOKEN"] = made.stdout.strip()
    # The example's publisher key is trusted for it: every publish signs, and an unsigned artifact never seals.
    kiln("keys", "add", f"{TEST_KEY}.pub", "--model", "tiny-llama", "--registry", str(data), env=env)
    env["KILN_SIGNING_KEY"] = str(TEST_KEY)
    # Model cars on a base image from a static busybox (a stand-in binary where there is none: the
    # registry serves the base's bytes as they are).
    busybox = Path("/bin/busybox")
    if not busybox.is_file():
        busybox = data / "busybox"
        busybox.write_bytes(STAND_IN_EXECUTABLE)
    kiln("modelcar-base", str(data / "modelcar-base"), "--busybox", str(busybox), env=env)
    server_env["KILN_REGISTRY_MODELCAR_BASE"] = str(data / "modelcar-base")
    log = open(data / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [*KILN, "serve", "--port", str(port)], env=server_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise AssertionError("registry did not start: " + (data / "server.log").read_text())
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def published(server: str, env: dict[str, str]) -> str:
    """The example published and promoted to prod, once for the module (a publish of the 29 artifacts takes
    10-20 s); yields the registry's URL. Publishing again is test_publish_promote_resolve_download_and_load's."""
    kiln("publish", str(RECIPE), "--registry", server, "--json", env=env)
    kiln("promote", "tiny-llama@1.0.0", "--channel", "prod", "--registry", server, env=env)
    return server


def test_build_twice_reuses_every_stage(env: dict[str, str]) -> None:
    first = json.loads(kiln("build", str(RECIPE), "--json", env=env).stdout)
    assert first["failed_gates"] == []
    # Everything evaluated here passed; the rest waits for a GPU runner (never counted as passed).
    waiting = {a["artifact"]: a["eval"] for a in first["artifacts"] if a["eval"] != "passed"}
    assert waiting == {"trtllm-w4a16-awq": "not_evaluated", "trtllm-nvfp4-w4a4": "not_evaluated"}
    gpu_evals = {f"gpu-eval/trtllm-{q}@{sku}" for q in ("bf16", "fp8", "w4a16-awq") for sku in ("h100", "h200")}
    assert {d["node"] for d in first["deferred"]} == {*gpu_evals, "gpu-eval/trtllm-nvfp4-w4a4@b200"}
    f16 = next(a for a in first["artifacts"] if a["artifact"] == "gguf-f16")
    assert f16["metrics"]["top1"] >= 0.99 and f16["metrics"]["kl"] <= 1e-3
    # Every artifact the example builds passes the lint (each export stage ran it too), the GGUFs against the
    # source's config as the export stage checks them.
    exports = sorted((Path(env["KILN_WORK_DIR"]) / "export").glob("*/files"))
    assert len(exports) == len(first["artifacts"])
    source = ROOT / "examples" / "tiny-llama" / "model"
    linted = json.loads(kiln("lint", *map(str, exports), "--config", str(source), "--json", env=env).stdout)
    assert linted["ok"] and {a["format"] for a in linted["artifacts"]} == {"gguf-v3", "safetensors", "orbax-checkpoint"}
    assert [f for a in linted["artifacts"] for f in a["findings"]] == []

    second = json.loads(kiln("build", str(RECIPE), "--json", env=env).stdout)
    assert second["stages"] == {"cached": sum(first["stages"].values()) - 7, "deferred": 7}


def test_publish_promote_resolve_download_and_load(published: str, env: dict[str, str], tmp_path: Path) -> None:
    server = published
    again = json.loads(kiln("publish", str(RECIPE), "--registry", server, "--json", env=env).stdout)
    assert again["failed_gates"] == []  # re-publishing identical content is accepted as is
    # Sealed with the key trusted, so every artifact carries a verified signature; one checked offline here.
    verified = kiln(
        "verify", "tiny-llama@1.0.0/gguf-q4_k_m", "--key", f"{TEST_KEY}.pub", "--registry", server, "--json", env=env
    )
    assert json.loads(verified.stdout)["provenance"] is True

    kiln("promote", "tiny-llama@1.0.0", "--channel", "prod", "--registry", server, env=env)
    resolved = kiln("resolve", "tiny-llama", "--hardware", "cpu", "--registry", server, "--json", env=env)
    answer = json.loads(resolved.stdout)
    assert answer["version"] == "1.0.0" and answer["hardware"] == "cpu"
    gguf = next(
        (a for a in [answer, *answer["fallbacks"]] if a["artifact"]["target"] == "gguf"),
        None,
    )
    assert gguf is not None, answer
    (entry,) = gguf["artifact"]["files"]

    path = tmp_path / entry["path"]
    digest = hashlib.sha256()
    with httpx.stream("GET", entry["url"], timeout=60) as r, open(path, "wb") as f:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            digest.update(chunk)
            f.write(chunk)
    assert digest.hexdigest() == entry["sha256"]
    assert path.stat().st_size == entry["size"]

    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    try:
        out = llm.create_completion("def ", max_tokens=8, temperature=0.0)
        assert out["choices"][0]["text"]
    finally:
        llm.close()


def test_huggingface_hub_pulls_the_gguf_and_the_bundle(published: str, env: dict[str, str], tmp_path: Path) -> None:
    """A serving node with HF_ENDPOINT at the registry pulls with the stock client, then loads what it got."""
    server = published
    script = (
        "import sys; from huggingface_hub import snapshot_download; "
        "print(snapshot_download('tiny-llama', revision=sys.argv[1], cache_dir=sys.argv[2]))"
    )
    node_env = {**env, "HF_ENDPOINT": server, "HF_HUB_DISABLE_TELEMETRY": "1"}
    node_env.pop("KILN_TOKEN")  # anonymous read, as a serving node
    pulled = {}
    for revision in ("prod/gguf-q4_k_m", "prod/hf-bundle-bf16"):
        proc = subprocess.run(
            [sys.executable, "-c", script, revision, str(tmp_path / "hf")],
            capture_output=True,
            text=True,
            env=node_env,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        pulled[revision] = Path(proc.stdout.strip().splitlines()[-1])
    (gguf,) = pulled["prod/gguf-q4_k_m"].glob("*.gguf")
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=64, n_threads=2, verbose=False)
    llm.close()
    import torch
    import transformers

    bundle = pulled["prod/hf-bundle-bf16"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bundle), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bundle))
    with torch.inference_mode():
        logits = model(**tokenizer("def main():", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def test_tpu_pools_resolve_to_orbax_which_restores_from_the_registry(
    published: str, env: dict[str, str], tmp_path: Path
) -> None:
    """A TPU v5e pool is offered only the orbax artifacts; every published file downloads, and the
    checkpoint restores and runs in the JAX runtime from that download alone."""
    server = published
    answer = json.loads(
        kiln("resolve", "tiny-llama", "--hardware", "tpu-v5e", "--registry", server, "--json", env=env).stdout
    )
    assert answer["hardware"] == "tpu-v5e" and answer["reason"]["fits"]
    candidates = [answer, *answer["fallbacks"]]
    assert {c["artifact"]["target"] for c in candidates} == {"orbax"} and len(candidates) == 2
    assert all(c["reason"]["eval_status"] == "passed" for c in candidates)

    artifact = answer["artifact"]
    for entry in artifact["files"]:
        path = tmp_path / entry["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        body = httpx.get(entry["url"], timeout=60).content
        assert hashlib.sha256(body).hexdigest() == entry["sha256"]
        path.write_bytes(body)

    from kiln.eval.runtimes import JaxRuntime

    rt = JaxRuntime(tmp_path)
    try:
        assert rt.quant == artifact["quant"]
        assert [len(g) for g in rt.greedy([[0, 1, 2, 3]], 4)] == [4]
    finally:
        rt.close()


def test_unknown_hardware_and_missing_model_give_clear_errors(server: str, env: dict[str, str]) -> None:
    bad = kiln("resolve", "tiny-llama", "--hardware", "tpu-v9", "--registry", server, env=env, check=False)
    assert bad.returncode == 2 and "known" in bad.stderr
    missing = kiln("resolve", "no-such-model", "--hardware", "cpu", "--registry", server, env=env, check=False)
    assert missing.returncode == 4


def test_oras_and_skopeo_fetch_the_gguf_from_the_registry(published: str, env: dict[str, str], tmp_path: Path) -> None:
    """OCI clients pull the example's GGUF by its channel tag: the files are the published ones, byte for byte."""
    import shutil

    import oras.client

    server = published
    resolved = json.loads(
        kiln("resolve", "tiny-llama", "--hardware", "cpu", "--registry", server, "--json", env=env).stdout
    )
    assert resolved["artifact"]["name"] == "gguf-q4_k_m"
    published = {f["path"]: f["sha256"] for f in resolved["artifact"]["files"]}
    host = server.removeprefix("http://")

    pulled = oras.client.OrasClient(hostname=host, insecure=True).pull(
        target=f"{host}/tiny-llama:prod-gguf-q4_k_m", outdir=str(tmp_path / "oras")
    )
    got = {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in pulled}
    assert got == published

    skopeo = shutil.which("skopeo")
    if skopeo is None and os.environ.get("KILN_REQUIRE_SKOPEO") != "1":
        pytest.skip("skopeo is not installed (apt-get install skopeo)")
    layout = tmp_path / "layout"
    subprocess.run(
        [
            skopeo or "skopeo",
            "copy",
            "--src-tls-verify=false",
            f"docker://{host}/tiny-llama:prod-gguf-q4_k_m",
            f"oci:{layout}:gguf",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    blobs = {p.name for p in (layout / "blobs" / "sha256").iterdir()}
    assert set(published.values()) <= blobs


def test_skopeo_copies_the_orbax_checkpoint_as_a_model_car(published: str, env: dict[str, str], tmp_path: Path) -> None:
    """The example's orbax checkpoint (144 files) as a KServe model car: packed into 100 file layers above
    the base's, which unpack (in order, with tar) to the published files under /models."""
    import shutil

    server = published

    skopeo = shutil.which("skopeo")
    if skopeo is None and os.environ.get("KILN_REQUIRE_SKOPEO") != "1":
        pytest.skip("skopeo is not installed (apt-get install skopeo)")
    resolved = json.loads(
        kiln("resolve", "tiny-llama", "--hardware", "tpu-v5e", "--registry", server, "--json", env=env).stdout
    )
    artifact = resolved["artifact"]
    assert len(artifact["files"]) > 100
    host = server.removeprefix("http://")
    layout = tmp_path / "layout"
    subprocess.run(
        [
            skopeo or "skopeo",
            "copy",
            "--src-tls-verify=false",
            f"docker://{host}/modelcar/tiny-llama:prod-{artifact['name']}",
            f"oci:{layout}:car",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs" / "sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    assert len(manifest["layers"]) == 1 + 100  # the busybox base, then the files packed into 100 layers
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    for layer in manifest["layers"]:
        blob = layout / "blobs" / "sha256" / layer["digest"][7:]
        subprocess.run(["tar", "-xf", str(blob), "-C", str(rootfs)], check=True, timeout=60)
    for f in artifact["files"]:
        assert hashlib.sha256((rootfs / "models" / f["path"]).read_bytes()).hexdigest() == f["sha256"], f["path"]
