"""A real S3-speaking server for the tests: moto's server mode, as a child process on a free loopback port.

The registry talks to it with boto3 over HTTP exactly as it would to S3 or MinIO. One server and
one bucket per test session; every test gets a fresh prefix (`s3://kiln-test/<random>/`), so
tests never see each other's objects.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiln.storage.s3 import MIN_PART_SIZE, make_s3_client

BUCKET = "kiln-test"
# Small parts keep multipart uploads fast in tests: a 12 MiB blob goes up as 5 + 5 + 2 MiB.
TEST_PART_SIZE = MIN_PART_SIZE
# Credentials for the test server only; boto3 reads them from the environment like real ones.
TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "kiln-test",
    "AWS_SECRET_ACCESS_KEY": "kiln-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # Never fall back to a developer's ~/.aws files or the instance metadata service.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class S3Server:
    endpoint_url: str
    client: Any

    def new_url(self) -> str:
        """A blob store URL no other test uses."""
        return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"

    def settings(self) -> dict[str, Any]:
        """RegistrySettings fields for a store on this server (streamed downloads, small parts)."""
        return {"s3_endpoint_url": self.endpoint_url, "s3_part_size": TEST_PART_SIZE, "s3_downloads": "stream"}

    def leftovers(self, url: str) -> list[str]:
        """Every object and unfinished multipart upload under a store URL's prefix."""
        prefix = url.removeprefix(f"s3://{BUCKET}/").rstrip("/") + "/"
        keys = [o["Key"] for o in self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
        uploads = self.client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
        return sorted(keys + [f"(unfinished upload) {u['Key']}" for u in uploads])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@contextlib.contextmanager
def running_s3_server(log: Path) -> Iterator[S3Server]:
    """moto's S3 server on a free 127.0.0.1 port, with the test bucket; the test credentials must be in
    the environment (`TEST_ENV`). Stopped on exit. The benchmarks use it too."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ},
        )
        try:
            endpoint = f"http://127.0.0.1:{port}"
            _wait_until_up(port, process, log)
            client = make_s3_client(endpoint)
            client.create_bucket(Bucket=BUCKET)
            yield S3Server(endpoint_url=endpoint, client=client)
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1, started for this test session and stopped at its end."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in TEST_ENV.items():
            env.setenv(name, value)
        with running_s3_server(tmp_path_factory.mktemp("s3-server") / "moto.log") as server:
            yield server


def _wait_until_up(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 test server exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the S3 test server did not start within 60 s:\n{log.read_text()[-2000:]}")
