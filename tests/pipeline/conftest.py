"""Fixtures of the pipeline tests: a two-node Ray cluster (the S3 server is every test's, tests/conftest.py)."""

from tests.pipeline.ray_cluster import ray_cluster  # noqa: F401 - the fixture
