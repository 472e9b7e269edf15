"""A real two-node Ray cluster on this machine, bound to loopback, for the executor's tests.

`ray start --head --node-ip-address=127.0.0.1` and a second `ray start --address=...` that advertises
`accelerator:h100`: two raylets, each with one CPU and its own object store, on 127.0.0.1 (Ray's
`cluster_utils.Cluster` binds to the machine's interface address instead). The head advertises
`accelerator:mi300x`, so a test can pin a stage to either node. The test cluster's second node also
offers one GPU (`--num-gpus=1`, a count Ray schedules by: there is no GPU behind it), for placement.
Both nodes get the S3 test server's endpoint and credentials and `PYTHONPATH` with the repository, so
workers import the test stages.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.registry.s3_server import TEST_ENV, S3Server, free_port

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
HEAD_RESOURCES: dict[str, float] = {"accelerator:mi300x": 1}
WORKER_RESOURCES: dict[str, float] = {"accelerator:h100": 1}


@dataclass
class RayCluster:
    address: str
    env: dict[str, str]
    temp_dir: Path

    def nodes(self) -> list[dict[str, Any]]:
        """The live nodes, as `ray.nodes()` describes them (asked from a fresh process)."""
        script = (
            f"import json, ray; ray.init(address={self.address!r}, log_to_driver=False); "
            "print(json.dumps([n for n in ray.nodes() if n['Alive']], default=str))"
        )
        out = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True, text=True, check=True)
        alive: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
        return alive

    def node_ids(self) -> dict[str, str]:
        """{accelerator resource: Ray node id} of the nodes."""
        return {r: n["NodeID"] for n in self.nodes() for r in n["Resources"] if r.startswith("accelerator:")}


def _ray(*args: str, env: dict[str, str]) -> None:
    done = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"ray {' '.join(args[:2])} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


@contextlib.contextmanager
def running_ray_cluster(
    s3: S3Server,
    head: dict[str, float] = HEAD_RESOURCES,
    worker: dict[str, float] = WORKER_RESOURCES,
    cpus: int = 1,
    worker_gpus: int = 0,
) -> Iterator[RayCluster]:
    """`ray start` a head and a second node on loopback, `cpus` CPUs each, with these custom resources (and
    `worker_gpus` GPUs on the second); its processes, and only they, stopped on exit (`stop_cluster`). The
    benchmarks use it too."""
    if not Path(RAY).is_file():
        raise RuntimeError("ray is not installed in this environment (make install installs it)")
    port = free_port()
    temp_dir = Path(f"/tmp/kiln-ray-{port}")  # short: Ray's unix socket paths must fit 107 bytes
    env = {
        **os.environ,
        **TEST_ENV,
        "KILN_S3_ENDPOINT_URL": s3.endpoint_url,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray's token authentication (on by default for `ray start --head`), with this cluster's own token.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    }
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--disable-usage-stats"]
    try:
        _ray(
            "start",
            "--head",
            f"--port={port}",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=false",
            f"--resources={json.dumps(head)}",
            *common,
            env=env,
        )
        gpus = [f"--num-gpus={worker_gpus}"]
        _ray("start", f"--address=127.0.0.1:{port}", f"--resources={json.dumps(worker)}", *gpus, *common, env=env)
        cluster = RayCluster(address=f"127.0.0.1:{port}", env=env, temp_dir=temp_dir)
        deadline = time.monotonic() + 60
        while len(cluster.nodes()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the second Ray node did not join")
            time.sleep(0.5)
        yield cluster
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, command line)} of this machine's processes (Linux's /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            found[int(entry.name)] = (
                parent,
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"),
            )
        except (OSError, ValueError, IndexError):
            continue  # ended while being read
    return found


def stop_cluster(temp_dir: Path, timeout: float = 30) -> None:
    """Stop this cluster's processes, those started with its `temp_dir` and their children (the raylets' workers
    and agents), and nothing else: `ray stop` would stop every Ray process of this user on the machine."""
    processes = _processes()
    ours = {pid for pid, (_, command) in processes.items() if str(temp_dir) in command}
    while True:  # and their descendants
        more = {pid for pid, (parent, _) in processes.items() if parent in ours} - ours
        if not more:
            break
        ours |= more
    me = os.getpid()
    while me in processes:  # never this process or one it runs under (a shell whose command names the dir)
        ours.discard(me)
        me = processes[me][0] if me != processes[me][0] else 0
    for pid in ours:  # as `ray stop --force` does: Ray's daemons take their time over a SIGTERM
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in ours):
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (not ended, nor ended and waiting to be reaped)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split() or ["Z"])[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def ray_cluster(s3_server: S3Server) -> Iterator[RayCluster]:
    with running_ray_cluster(s3_server, worker_gpus=1) as cluster, pytest.MonkeyPatch.context() as patch:
        # This process drives builds on the cluster too.
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "KILN_S3_ENDPOINT_URL", "RAY_USAGE_STATS_ENABLED"):
            patch.setenv(name, cluster.env[name])
        yield cluster
        import ray

        ray.shutdown()
