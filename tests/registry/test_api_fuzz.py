"""Property-based fuzzing of every API operation from the OpenAPI schema (schemathesis), with a valid
token of each scope, on both deployments: no server error, and every response (status, headers,
body) as the schema documents it.

Half of the generated cases are pointed at the things that exist (a sealed release on prod, an open
one, their artifacts and files), so the fuzzer exercises the routes past their 404s. Examples per
operation and mode (valid and invalid inputs): KILN_FUZZ_EXAMPLES, default 6; a longer run is
`KILN_FUZZ_EXAMPLES=200 pytest -s tests/registry/test_api_fuzz.py`, which prints the counts.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections import Counter
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import CHECKS as REGISTERED_CHECKS
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient

from tests.registry.conftest import make_token
from tests.registry.helpers import make_release, post_eval, promote, publish, seal

EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "6"))
SCOPES = ["read", "publish", "promote", "admin"]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# What exists after `_seed`, for path parameters of that name.
EXISTING: dict[str, list[str]] = {
    "model": ["tiny"],
    "version": ["1.0", "2.0"],
    "name": ["gguf-q8", "gguf-q4"],
    "channel": ["prod", "dev"],
    "path": ["model.gguf"],
    "repo": ["tiny"],
    "namespace": ["kiln"],
}


def _seed(client: TestClient) -> None:
    make_release(client, planned=["gguf-q4", "gguf-q8"])
    publish(client, "gguf-q8", {"model.gguf": b"q8" * 64}, ["cpu"])
    publish(client, "gguf-q4", {"model.gguf": b"q4" * 32}, ["cpu"], quant="q4_0")
    post_eval(client, "gguf-q8", "passed", metrics={"kl": 0.001})
    post_eval(client, "gguf-q4", "failed", metrics={"kl": 0.3}, reason="kl too high")
    seal(client)
    assert promote(client, force=True, reason="fuzz seed").status_code == 200
    make_release(client, version="2.0")
    publish(client, "gguf-q8", {"model.gguf": b"open" * 16}, ["cpu"], version="2.0")


@pytest.fixture
def tokens(app: FastAPI, client: TestClient) -> dict[str, str]:
    """The seeded registry's tokens, one per scope."""
    _seed(client)
    return {scope: make_token(app, [scope], name=f"fuzz-{scope}") for scope in SCOPES}


def _fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    token: str | None,
    failures: list[str],
    examples: int = EXAMPLES,
    checks: list[Any] = CHECKS,
) -> int:
    """Run `examples` generated cases of one operation; record each check failure. Returns the cases run."""
    ran = 0
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal ran
        ran += 1
        key = repr((case.method, case.path, case.path_parameters, case.query)).encode()
        digest = int(hashlib.sha256(key).hexdigest(), 16)
        if case.path_parameters and digest % 2:
            for name, values in EXISTING.items():
                if name in case.path_parameters:
                    case.path_parameters[name] = values[digest % len(values)]
        try:
            case.call_and_validate(headers=headers, checks=checks)
        except (AssertionError, Failure, FailureGroup) as exc:
            failures.append(f"{case.method} {case.formatted_path} {mode.value}: {str(exc)[:2000]}")

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid: an operation without parameters or body
        assert mode is GenerationMode.NEGATIVE
    return ran


@pytest.mark.parametrize("scope", SCOPES)
def test_api_answers_every_input_as_documented(app: FastAPI, tokens: dict[str, str], scope: str) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # an invalid schema raises here
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            cases += _fuzz_operation(operation, mode, tokens[scope], failures)
    assert cases > 0
    print(f"api fuzz ({scope}): {cases} cases, {len(failures)} failures")  # shown with -s: the suite's counts
    assert not failures, f"{len(failures)} of {cases} cases failed:\n" + "\n\n".join(failures[:20])


# Cases per operation and mode: as an unrestricted admin (the deep paths), and anonymously (mostly 401s).
DEEP_EXAMPLES = {
    "admin": int(os.environ.get("KILN_FUZZ_DEEP_EXAMPLES", "50")),
    "anonymous": int(os.environ.get("KILN_FUZZ_DEEP_EXAMPLES_ANONYMOUS", "15")),
}
# positive_data_acceptance expects every schema-valid request to be accepted; the registry checks more
# than a schema says (a file path's segments, a release that is abandoned: 410, a name that exists), so
# it refuses some with 4xx and an error code. Its server errors are still caught by not_a_server_error.
NOT_APPLICABLE = {"positive_data_acceptance"}


@pytest.mark.slow
@pytest.mark.parametrize("who", ["admin", "anonymous"])
def test_api_answers_every_input_without_a_server_error(app: FastAPI, tokens: dict[str, str], who: str) -> None:
    """Every check schemathesis has (`--checks all`, but NOT_APPLICABLE), DEEP_EXAMPLES cases per
    operation and mode, on the seeded registry: no 5xx anywhere, every answer as documented."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    checks = [c for c in REGISTERED_CHECKS.get_all() if c.__name__ not in NOT_APPLICABLE]
    assert len(checks) > len(CHECKS) and not_a_server_error in checks
    token = tokens["admin"] if who == "admin" else None
    failures: list[str] = []
    cases = 0
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            cases += _fuzz_operation(operation, mode, token, failures, DEEP_EXAMPLES[who], checks)
    operations = len(list(schema.get_all_operations()))
    print(f"api fuzz, all checks ({who}): {operations} operations, {cases} cases in {time.monotonic() - started:.0f} s")
    # A body past the route's limit is refused with 413 (PAYLOAD_TOO_LARGE): a rejection, which
    # negative_data_rejection does not count as one.
    failures = [f for f in failures if not ("ST201" in f and "[413]" in f and "PAYLOAD_TOO_LARGE" in f)]
    kinds = Counter(title for f in failures for title in re.findall(r"^- (.+)$", f, re.MULTILINE))
    print(f"api fuzz, all checks ({who}): failures by check: {dict(kinds)}")
    server_errors = [f for f in failures if "Server error" in f]
    assert not server_errors, f"{len(server_errors)} of {cases} cases were server errors:\n" + "\n\n".join(
        server_errors[:20]
    )
    assert not failures, f"{len(failures)} of {cases} cases failed:\n" + "\n\n".join(failures[:20])
