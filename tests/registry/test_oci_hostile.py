"""The OCI pull API as an attacker and a confused client see it: generated repository names, references,
digests, byte ranges and methods, on a registry that serves ModelPack artifacts and model cars.

Whatever is asked: no server error; an error has the spec's shape and one of its codes; an answer's
`Docker-Content-Digest` is the sha256 of its bytes (GET); a part of a blob is the matching slice of the
whole. The OpenAPI fuzzing (`test_api_fuzz.py`) does not reach these routes: they are not in the schema.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from tests.registry.conftest import make_token
from tests.registry.test_modelcar import CAR, base_layout  # noqa: F401 - the base image fixture
from tests.registry.test_oci import MODEL, TAG, _seed

SPEC_CODES = {
    "NAME_UNKNOWN",
    "NAME_INVALID",
    "MANIFEST_UNKNOWN",
    "TAG_INVALID",
    "BLOB_UNKNOWN",
    "DIGEST_INVALID",
    "UNAUTHORIZED",
    "DENIED",
    "UNSUPPORTED",
}


@pytest.fixture
def probe(settings: RegistrySettings, base_layout: Path) -> Iterator[tuple[TestClient, dict[str, Any]]]:  # noqa: F811
    """A seeded registry with model cars, and what is really in it (to aim some probes at)."""
    app: FastAPI = create_app(settings.model_copy(update={"modelcar_base": base_layout}))
    token = make_token(app, ["admin"], name="root")
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        _seed(client)
        known: dict[str, Any] = {"digests": []}
        for repository in (MODEL, CAR):
            manifest = client.get(f"/v2/{repository}/manifests/{TAG}")
            known["digests"] += [manifest.headers["docker-content-digest"], manifest.json()["config"]["digest"]]
            known["digests"] += [layer["digest"] for layer in manifest.json()["layers"]]
        yield client, known
    app.state.engine.dispose()


# Printable text: a URL with control characters is refused by the client before it is sent.
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=40)
_repository = st.one_of(
    st.sampled_from([MODEL, f"kiln/{MODEL}", CAR, "modelcar/none", "other", "a/b/c", "..", "modelcar/..", "%2e%2e"]),
    st.builds(lambda p, n: f"{p}{n}", st.sampled_from(["", "kiln/", "modelcar/", "x/"]), _text),
    st.text("abc-_./", min_size=1, max_size=300),
)
_hex = st.text("0123456789abcdef", min_size=64, max_size=64)
_ranges = st.one_of(
    st.none(),
    st.builds(lambda a, b: f"bytes={a}-{b}", st.integers(0, 40_000), st.integers(0, 40_000)),
    st.builds(lambda a: f"bytes={a}-", st.integers(0, 40_000)),
    st.builds(lambda n: f"bytes=-{n}", st.integers(0, 40_000)),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(lambda t: f"bytes={t}"),
    st.just("bytes=" + "9" * 400 + "-"),
)


def _check(response: Any, method: str, *, digest_of_body: bool) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        # A name of dot segments leaves /v2/ once the URL is normalised: kiln's own routes answer those.
        in_v2 = response.request.url.path.startswith("/v2/")
        if in_v2 and method == "GET" and response.headers.get("content-type", "").startswith("application/json"):
            body = response.json()
            assert "errors" in body, (response.request.url, response.status_code, body)
            errors = body["errors"]
            assert [e["code"] for e in errors if e["code"] not in SPEC_CODES] == [], errors
        return
    if method == "GET" and response.status_code == 200 and digest_of_body:
        expected = response.headers.get("docker-content-digest")
        if expected is not None:
            assert expected == f"sha256:{hashlib.sha256(response.content).hexdigest()}"


HYPOTHESIS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@HYPOTHESIS
@given(
    repository=_repository,
    reference=st.one_of(
        st.sampled_from([TAG, "prod-gguf-q4_k_m", "latest", "sha256:", "sha256:" + "0" * 64, "a" * 129]),
        _text,
        _hex.map(lambda h: f"sha256:{h}"),
    ),
    method=st.sampled_from(["GET", "HEAD"]),
)
def test_any_manifest_request(
    probe: tuple[TestClient, dict[str, Any]], repository: str, reference: str, method: str
) -> None:
    client, _ = probe
    response = client.request(method, f"/v2/{repository}/manifests/{reference}")
    _check(response, method, digest_of_body=True)


@HYPOTHESIS
@given(
    repository=_repository,
    digest=st.one_of(st.just("known"), _hex.map(lambda h: f"sha256:{h}"), _text),
    which=st.integers(0, 100),
    byte_range=_ranges,
    method=st.sampled_from(["GET", "HEAD"]),
)
def test_any_blob_request(
    probe: tuple[TestClient, dict[str, Any]],
    repository: str,
    digest: str,
    which: int,
    byte_range: str | None,
    method: str,
) -> None:
    client, known = probe
    if digest == "known":  # a digest the registry holds, under any repository name
        digest = known["digests"][which % len(known["digests"])]
    headers = {} if byte_range is None else {"Range": byte_range}
    response = client.request(method, f"/v2/{repository}/blobs/{digest}", headers=headers)
    _check(response, method, digest_of_body=byte_range is None)
    if response.status_code == 206 and method == "GET":
        whole = client.get(f"/v2/{repository}/blobs/{digest}")
        first, last = (int(x) for x in response.headers["content-range"].split()[1].split("/")[0].split("-"))
        assert response.content == whole.content[first : last + 1]


@HYPOTHESIS
@given(
    repository=_repository,
    path=st.sampled_from(["tags/list", "referrers/sha256:" + "0" * 64, "referrers/nope", ""]),
    query=st.one_of(st.just(""), st.builds(lambda n, last: f"?n={n}&last={last}", st.integers(-5, 20_000), _text)),
)
def test_any_listing_request(probe: tuple[TestClient, dict[str, Any]], repository: str, path: str, query: str) -> None:
    client, _ = probe
    response = client.get(f"/v2/{repository}/{path}{query}")
    _check(response, "GET", digest_of_body=False)


@pytest.mark.parametrize("name", [f"/{MODEL}", f"//{MODEL}", f"kiln//{MODEL}", f"/kiln/{MODEL}", f"{MODEL}/", "/"])
def test_a_repository_name_with_an_empty_segment_names_nothing(
    probe: tuple[TestClient, dict[str, Any]], name: str
) -> None:
    """`/v2//tiny-llama/...` is not `/v2/tiny-llama/...`: no client names a repository with an empty segment."""
    client, known = probe
    for path in ("tags/list", f"manifests/{TAG}", f"blobs/{known['digests'][0]}", f"referrers/{known['digests'][0]}"):
        response = client.get(f"/v2/{name}/{path}")
        assert response.status_code in (400, 404), (name, path, response.status_code, response.text[:200])
        assert response.json()["errors"][0]["code"] in ("NAME_INVALID", "NAME_UNKNOWN"), (name, path)
