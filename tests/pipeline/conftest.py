"""Fixtures of the pipeline tests: moto's S3 server (the shared stage store) and a two-node Ray cluster."""

from tests.pipeline.ray_cluster import ray_cluster  # noqa: F401 - the fixture
from tests.registry.s3_server import s3_server  # noqa: F401 - the fixture
