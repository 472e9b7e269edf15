import os

import pytest

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # AMX is advertised but faults here

# moto's S3 server, one for the session: the registry's blob store and the pipeline's stage store use it.
from tests.registry.s3_server import s3_server  # noqa: E402, F401 - the fixture

# The files that take a minute or more, longest first: seconds each took in `make test`'s two-worker phase
# (2026-11-30, 1,707 s in all). xdist hands files out in collection order (`--no-loadscope-reorder` in
# pyproject.toml; its default order, most tests first, left these files, with one to seven tests each, to the
# end, where one worker ran the last of them for minutes while the other had nothing left to run).
LONGEST_FIRST = (
    "tests/test_end_to_end.py",  # 335 s
    "tests/targets/test_hf_bundle_families.py",  # 225 s
    "tests/registry/test_api_fuzz.py",  # 207 s
    "tests/registry/test_publish_crash.py",  # 202 s
    "tests/test_release_workflow.py",  # 134 s
    "tests/targets/test_gguf_frontier.py",  # 134 s
    "tests/pipeline/test_ray_executor.py",  # 119 s
    "tests/test_families.py",  # 112 s
    "tests/registry/test_api_paging.py",  # 95 s
    "tests/eval/test_vllm_runtime.py",  # 90 s
    "tests/eval/test_vllm_families.py",  # 81 s
    "tests/kiln/test_cli.py",  # 81 s
    "tests/registry/test_routing.py",  # 76 s
    "tests/pipeline/test_frontier_builds.py",  # 72 s
    "tests/kiln/test_cli_files.py",  # 72 s
    "tests/placement/test_vllm_kv.py",  # 71 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (a stable sort: each file's tests, and the other files, keep their order)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(LONGEST_FIRST)))
