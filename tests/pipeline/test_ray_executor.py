"""The Ray executor on a real two-node Ray cluster on loopback, with the stage store in a real S3 server.

Each Ray node keeps its own copy of the store (`<work>/nodes/<node id>/`), so what one stage reads of
another's output crossed the bucket. The nodes: the head offers `accelerator:mi300x`, the second
`accelerator:h100`, one CPU each (`tests/pipeline/ray_cluster.py`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.core.device import CPU, Device, InvalidDevice
from kiln.core.digest import sha256_json
from kiln.core.errors import InvalidInput
from kiln.pipeline.executors.ray import RayExecutor
from kiln.pipeline.placement import placed, with_device
from kiln.pipeline.store import RemoteStageStore, WorkDir
from tests.pipeline.ray_cluster import ROOT, RayCluster
from tests.pipeline.ray_stages import toy
from tests.registry.s3_server import S3Server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning")


def _store(s3: S3Server, tmp_path: Path, url: str | None = None) -> RemoteStageStore:
    return RemoteStageStore(url or s3.new_url(), WorkDir(tmp_path / "driver"), endpoint_url=s3.endpoint_url)


def _executor(cluster: RayCluster, store: RemoteStageStore, retries: int = 3) -> RayExecutor:
    return RayExecutor(store, store.url, address=cluster.address, max_retries=retries)


def test_stages_run_where_their_accelerator_is_and_read_each_other_through_the_store(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    store = _store(s3_server, tmp_path)
    nodes = [
        toy("source"),
        toy("gpu", inputs={"a": "toy/source"}, accelerator="nvidia:h100"),
        toy("other", inputs={"a": "toy/gpu"}, accelerator="amd:mi300x"),
        toy("side", inputs={"a": "toy/source"}),
    ]
    outcomes = _executor(ray_cluster, store).run(nodes)
    assert {n: o.status for n, o in outcomes.items()} == dict.fromkeys(outcomes, "built")
    ids = ray_cluster.node_ids()
    where = {n: o.output.provenance["executor"] for n, o in outcomes.items() if o.output is not None}
    assert where["toy/gpu"]["ray_node_id"] == ids["accelerator:h100"] and where["toy/gpu"]["accelerators"] == ["h100"]
    assert where["toy/other"]["ray_node_id"] == ids["accelerator:mi300x"]
    # toy/other read toy/gpu's output on the other node: through the bucket, into its own copy.
    other = outcomes["toy/other"].output
    assert other is not None and json.loads(other.result.upstream[0])["node"] == "toy/gpu"  # type: ignore[attr-defined]
    work = tmp_path / "driver" / "nodes"
    assert (work / ids["accelerator:mi300x"] / "toy").is_dir() and (work / ids["accelerator:h100"] / "toy").is_dir()
    # Every output is in the bucket: stage.json under its key, files by content.
    for outcome in outcomes.values():
        assert store.digest(outcome.node, outcome.key or "") == outcome.output.digest  # type: ignore[union-attr]
    # A second run finds every stage in the store.
    again = _executor(ray_cluster, _store(s3_server, tmp_path / "again", store.url)).run(nodes)
    assert {o.status for o in again.values()} == {"cached"}


def test_a_stage_run_by_a_ray_worker_records_what_it_used(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    """The worker's own peak, measured where the stage ran (`core.usage`), is in the provenance the driver reads."""
    store = _store(s3_server, tmp_path)
    outcomes = _executor(ray_cluster, store).run([toy("holds", hold_mib=128)])
    out = outcomes["toy/holds"].output
    assert out is not None and out.provenance["executor"]["ray_node_id"]
    used = out.provenance["resources"]
    assert used["peak_rss_bytes"] >= 128 << 20 and used["peak_anon_bytes"] - used["anon_start_bytes"] >= 120 << 20
    assert used["wall_s"] >= 0.2 and used["io"] is not None


def test_a_worker_killed_mid_stage_is_retried(ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path) -> None:
    store = _store(s3_server, tmp_path)
    attempts = tmp_path / "attempts"
    node = toy("dies-once", kill_once=str(tmp_path / "killed"), attempts=str(attempts))
    outcomes = _executor(ray_cluster, store).run([node, toy("after", inputs={"a": "toy/dies-once"})])
    assert [o.status for o in outcomes.values()] == ["built", "built"]
    assert len(attempts.read_text().split()) == 2  # SIGKILLed once, run again by Ray


def test_a_failed_stage_cancels_what_waits_on_it_and_nothing_else(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    store = _store(s3_server, tmp_path)
    attempts = tmp_path / "attempts"
    nodes = [
        toy("root"),
        toy("bad", inputs={"a": "toy/root"}, fail=True, attempts=str(attempts)),
        toy("after-bad", inputs={"a": "toy/bad"}),
        toy("good", inputs={"a": "toy/root"}),
    ]
    outcomes = _executor(ray_cluster, store).run(nodes)
    status = {n: o.status for n, o in outcomes.items()}
    assert status == {"toy/root": "built", "toy/bad": "failed", "toy/after-bad": "cancelled", "toy/good": "built"}
    assert isinstance(outcomes["toy/bad"].error, InvalidInput) and outcomes["toy/bad"].error.code == "SOURCE_INVALID"
    assert "toy/bad" in outcomes["toy/after-bad"].reason
    assert len(attempts.read_text().split()) == 1  # a kiln error is not retried
    leftovers = s3_server.leftovers(store.url)
    assert not [k for k in leftovers if "/toy/" in k and "stage.json" in k and "bad" in k]
    assert len([k for k in leftovers if k.endswith("stage.json")]) == 2  # root and good only


def test_a_stage_no_node_can_run_waits_for_its_hardware(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    store = _store(s3_server, tmp_path)
    nodes = [toy("root"), toy("tpu", inputs={"a": "toy/root"}, accelerator="google:tpu-v5e")]
    nodes.append(toy("after-tpu", inputs={"a": "toy/tpu"}))
    outcomes = _executor(ray_cluster, store).run(nodes)
    assert [o.status for o in outcomes.values()] == ["built", "deferred", "deferred"]
    assert outcomes["toy/tpu"].details["waiting_for"] == ["accelerator:tpu-v5e"]
    assert "google:tpu-v5e" in outcomes["toy/tpu"].reason and "toy/tpu" in outcomes["toy/after-tpu"].reason


def test_a_stage_placed_on_a_gpu_asks_ray_for_one_and_runs_where_ray_granted_it(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    """The cluster's h100 node offers one GPU (a count: nothing computes on it here): Ray's `num_gpus`."""
    store = _store(s3_server, tmp_path)
    nodes = [toy("on-gpu", gpus=1), toy("on-cpu", inputs={"a": "toy/on-gpu"}), toy("two-gpus", gpus=2)]
    outcomes = _executor(ray_cluster, store).run(nodes)
    assert {n: o.status for n, o in outcomes.items()} == {
        "toy/on-gpu": "built",
        "toy/on-cpu": "built",
        "toy/two-gpus": "deferred",
    }
    gpu = outcomes["toy/on-gpu"].output.provenance["executor"]  # type: ignore[union-attr]
    assert gpu["ray_node_id"] == ray_cluster.node_ids()["accelerator:h100"]
    assert gpu["gpu_ids"] == ["0"] and gpu["cuda_visible_devices"] == "0"  # Ray's grant, as the stage saw it
    cpu = outcomes["toy/on-cpu"].output.provenance["executor"]  # type: ignore[union-attr]
    assert cpu["gpu_ids"] == []  # it asked for none
    assert outcomes["toy/two-gpus"].details["waiting_for"] == ["GPU"]
    assert "2 GPU(s)" in outcomes["toy/two-gpus"].reason


def test_a_compute_stage_on_a_gpu_torch_cannot_see_fails_with_device_unavailable(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    """Placed on `cuda`, granted the node's GPU by Ray, but no CUDA device behind it: refused, never run on the CPU."""
    from kiln.core.device import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("this machine has a CUDA device")
    store = _store(s3_server, tmp_path)
    node = with_device(toy("reference-like"), Device("cuda"))
    node = replace(node, requires=placed(node, node.requires))
    assert node.requires.gpus == 1
    outcome = _executor(ray_cluster, store).run([node])[node.id]
    assert outcome.status == "failed" and outcome.error is not None
    assert outcome.error.code == "DEVICE_UNAVAILABLE" and "CUDA_VISIBLE_DEVICES=0" in outcome.error.message
    assert store.digest(node, outcome.key or node.cache_key({})) is None


def test_device_auto_on_a_cluster_is_a_gpu_when_a_node_offers_one(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    executor = _executor(ray_cluster, _store(s3_server, tmp_path))
    assert executor.placement("auto") == Device("cuda")
    assert executor.placement("cpu") == CPU and executor.placement(Device("cuda")) == Device("cuda")
    with pytest.raises(InvalidDevice, match="Ray chooses the GPU"):
        executor.placement("cuda:1")


RECIPE = """\
model: tiny-llama
version: 1.0.0
source: {model}
eval: {{text: heldout.txt, max_tokens: 512, window: 128, greedy_prompts: 2, greedy_tokens: 8}}
targets:
  - target: gguf
    quants: [f16, q8_0]
  - target: hf-bundle
    quants: [bf16, int8-w8a8]
"""


def _recipe(tmp_path: Path) -> Path:
    model = ROOT / "examples/tiny-llama/model"
    (tmp_path / "heldout.txt").write_text((ROOT / "examples/tiny-llama/heldout.txt").read_text())
    recipe = tmp_path / "kiln.yaml"
    recipe.write_text(RECIPE.format(model=model))
    return recipe


def _kiln(cluster: RayCluster, recipe: Path, work: Path, store: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kiln",
        "build",
        str(recipe),
        "--work-dir",
        str(work),
        "--store",
        store,
        "--allow-outside",
        str(ROOT / "examples/tiny-llama"),
        *extra,
    ]


def test_a_release_builds_on_the_cluster_with_the_digests_of_a_local_build_and_resumes_after_the_driver_dies(
    ray_cluster: RayCluster, s3_server: S3Server, tmp_path: Path
) -> None:
    recipe = _recipe(tmp_path)
    url = s3_server.new_url()
    cmd = _kiln(
        ray_cluster, recipe, tmp_path / "driver", url, "--executor", "ray", "--ray-address", ray_cluster.address
    )
    driver = subprocess.Popen(cmd, env=ray_cluster.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    prefix = url.removeprefix("s3://kiln-test/")
    deadline = time.monotonic() + 300
    while True:  # kill the driver once some stages are in the bucket, before the build is done
        done = [k for k in s3_server.leftovers(url) if k.endswith("stage.json")]
        if len(done) >= 3 or driver.poll() is not None:
            break
        assert time.monotonic() < deadline, "no stage finished in 300 s"
        time.sleep(0.2)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    finished = {k.removeprefix(prefix + "/") for k in s3_server.leftovers(url) if k.endswith("stage.json")}
    assert finished

    resumed = subprocess.run(
        [*cmd, "--json"], env=ray_cluster.env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads(resumed.stdout)
    # 14 stages: ingest, reference, prepare, 4 exports, 4 evals, and the 2 hf-bundles' evals in vLLM.
    assert not report["failed_gates"] and report["stages"].get("built", 0) + report["stages"].get("cached", 0) == 14
    assert report["stages"]["cached"] >= len(finished)  # every stage the killed driver finished is reused

    local = subprocess.run(
        [*_kiln(ray_cluster, recipe, tmp_path / "local", s3_server.new_url()), "--json"],
        env=ray_cluster.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert local.returncode == 0, local.stderr[-3000:]

    def outputs(url: str) -> dict[str, str]:
        found = {}
        for key in s3_server.leftovers(url):
            if key.endswith("stage.json"):
                body = s3_server.client.get_object(Bucket="kiln-test", Key=key)["Body"].read()
                meta = json.loads(body)
                found[meta["node"]] = sha256_json(
                    {"key": meta["key"], "files": meta["files"], "result": meta["result"]}
                )
        return found

    on_cluster, here = outputs(url), outputs(local.args[local.args.index("--store") + 1])
    assert len(on_cluster) == 14 and on_cluster == here  # the same keys, files and records, byte for byte
