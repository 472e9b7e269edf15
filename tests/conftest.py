import os

import pytest

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # AMX is advertised but faults here

# moto's S3 server, one for the session: the registry's blob store and the pipeline's stage store use it.
from tests.registry.s3_server import s3_server  # noqa: E402, F401 - the fixture


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a slow test first, each file's tests kept together and in order: `make test`'s workers take
    a file at a time, so the longest ones start early instead of ending the run on one worker alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group stays
