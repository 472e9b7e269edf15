"""The web pages over plain HTTP, on SQLite and PostgreSQL: structure, escaping, links, errors, read access."""

from __future__ import annotations

import json

from fastapi import FastAPI
from starlette.testclient import TestClient

from eval.gates import GATE_KEYS
from registry.app import create_app
from registry.settings import RegistrySettings
from registry.web.routes import not_found_router, router
from registry.web.views import METRIC_COLUMNS
from tests.registry.conftest import make_token
from tests.registry.helpers import make_release, post_eval, publish
from tests.registry.pages import DESCRIPTION, FAILURES, FILES, FORCED_REASON, YANK_REASON, Node, parse, seed


def page(client: TestClient, url: str, status: int = 200) -> Node:
    response = client.get(url)
    assert response.status_code == status, response.text[:2000]
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    # Whatever the user wrote reaches the page as text, never as markup.
    assert "<script" not in response.text.lower() and "<b>" not in response.text
    return parse(response.text)


def cells(group: Node) -> list[dict[str, str]]:
    """Per eval row of an artifact's row group: metric -> state, plus runtime and verdict."""
    rows = []
    for tr in group.find_all("tr"):
        metrics = [td for td in tr.find_all("td", class_="metric") if "data-state" in td.attrs]
        row = {td.attrs["data-metric"]: td.attrs["data-state"] for td in metrics}
        row |= {"runtime": tr.find("td", class_="runtime").text, "verdict": tr.find("td", class_="verdict").text}
        rows.append(row)
    return rows


def test_front_page_lists_models(client: TestClient) -> None:
    seed(client)
    assert client.get("/", follow_redirects=False).headers["location"] == "/ui/"
    doc = page(client, "/")
    row = doc.find("tr", data_model="tiny")
    assert row.find("a", href="/ui/models/tiny").text == "tiny"
    assert row.find("td", class_="description").text == " ".join(DESCRIPTION.split())
    assert row.find("a", href="/ui/models/tiny/releases/2.0").text == "2.0"
    assert row.find("a", href="/ui/models/tiny/channels/prod").text == "prod → 2.0"
    assert doc.find("link", rel="stylesheet").attrs["href"] == "/ui/static/kiln.css"
    css = client.get("/ui/static/kiln.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


def test_model_page_shows_releases_and_channels(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny")
    assert doc.find("p", id="description").text == " ".join(DESCRIPTION.split())
    versions = [tr.attrs["data-version"] for tr in doc.find("table", id="releases").find_all("tr") if tr.attrs]
    assert versions == ["3.0", "2.0", "1.0"]  # newest first
    assert doc.find("tr", data_version="3.0").attrs["data-status"] == "open"
    assert "not served until sealed" in doc.find("tr", data_version="3.0").text
    yanked = doc.find("tr", data_version="1.0")
    assert "yanked" in yanked.classes and yanked.find("span", class_="reason").text == YANK_REASON
    live = doc.find("tr", data_version="2.0")
    assert "yanked" not in live.classes and live.find("span", class_="channel").text == "prod"
    prod = doc.find("tr", data_channel="prod")
    assert prod.find("a", href="/ui/models/tiny/releases/2.0").text == "2.0"
    assert prod.find("a", href="/ui/models/tiny/channels/prod").text == "history"


def test_release_page_is_the_artifact_by_eval_matrix(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/2.0")
    matrix = doc.find("table", id="matrix")
    header = [th.text for th in matrix.find("thead").find_all("th")]
    assert header == [
        "Artifact",
        "Target",
        "Quant",
        "Size",
        "Runs on",
        "Eval runtime",
        "Perplexity change",
        "KL divergence",
        "Top-1 agreement",
        "Greedy match",
        "Verdict",
        "Files",
    ]
    groups = {g.attrs["data-artifact"]: g for g in matrix.find_all("tbody", class_="artifact")}
    assert list(groups) == ["gguf-q4_0", "gguf-q8_0", "hf-bundle-bf16", "trtllm-fp8"]
    assert {name: g.attrs["data-status"] for name, g in groups.items()} == {
        "gguf-q4_0": "failed",
        "gguf-q8_0": "passed",
        "hf-bundle-bf16": "not_evaluated",
        "trtllm-fp8": "not_evaluated",
    }

    q8 = groups["gguf-q8_0"]
    assert q8.find("th", class_="name").attrs["rowspan"] == "2"  # two runtimes, one row each
    assert [b.text for b in q8.find_all("span", class_="hw")] == ["cpu", "apple"]
    assert q8.find("td", class_="num").text == "800 B"
    assert cells(q8) == [
        {
            "ppl_change": "pass",
            "kl": "pass",
            "top1": "pass",
            "greedy_match": "ungated",
            "runtime": "llama.cpp",
            "verdict": "passed",
        },
        {"runtime": "llama.cpp-metal", "verdict": "not evaluated"},
    ]
    kl = q8.find("td", data_metric="kl")
    assert kl.text == "8.10e-05 ≤ 5.00e-03"
    assert "needs a runner with llama.cpp-metal" in q8.find("td", class_="not-evaluated").text

    q4 = groups["gguf-q4_0"]
    assert cells(q4) == [
        {
            "ppl_change": "fail",
            "kl": "fail",
            "top1": "pass",
            "greedy_match": "ungated",
            "runtime": "llama.cpp",
            "verdict": f"failed {FAILURES}",
        }
    ]
    assert q4.find("td", data_metric="ppl_change").text == "+21.00% ≤ +15.00%"
    assert q4.find("td", data_metric="top1").text == "0.8600 ≥ 0.8000"

    # Not evaluated here: said so, with the runner it needs and why; never "passed".
    fp8 = groups["trtllm-fp8"]
    assert "passed" not in fp8.text
    assert fp8.find("td", class_="not-evaluated").text == (
        "not evaluated here: needs a runner with tensorrt_llm "
        "needs a runner with tensorrt_llm and an H100; this machine has neither"
    )
    assert fp8.find("details", class_="unsupported").find("li").text == "a100 : FP8 tensor cores need sm89+"
    bundle = groups["hf-bundle-bf16"]
    assert "passed" not in bundle.text
    assert bundle.find("td", class_="not-evaluated").text == (
        "not evaluated here: needs a runner with vllm vLLM has no kernel for this scheme on this CPU"
    )

    # Download links fetch the files.
    for name, files in FILES.items():
        links = groups[name].find_all("a", class_="download")
        assert sorted(a.text for a in links) == sorted(files)
        for a in links:
            assert a.attrs["href"].startswith("http://testserver/v1/models/tiny/releases/2.0/artifacts/")
            assert client.get(a.attrs["href"]).content == files[a.text]


def test_yanked_release_page_says_so(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/1.0")
    assert YANK_REASON in doc.find("p", id="yanked").text
    assert doc.find("tbody", data_artifact="gguf-q8_0").attrs["data-status"] == "passed"
    assert doc.find_all("a", class_="download") == []  # a yanked release serves no file


def test_open_release_page_says_what_is_missing(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/3.0")
    banner = doc.find("p", id="open").text
    assert "1 of 2 planned artifacts" in banner and "missing: gguf-q4_0" in banner
    assert doc.find("tbody", data_artifact="gguf-q8_0").find("td", class_="not-evaluated").text == (
        "not evaluated no eval result was published for this artifact"
    )
    assert doc.find_all("a", class_="download") == []  # not served until sealed


def test_non_finite_metric_fails_its_gate(client: TestClient) -> None:
    make_release(client, planned=["gguf-q4"])
    publish(client, "gguf-q4", {"m.gguf": b"q4"}, ["cpu"], quant="q4_0")
    # How EvalMetrics serialises a NaN: the string "NaN".
    metrics = {"kl": "NaN", "top1": 0.9, "ppl_change": 0.01}
    assert post_eval(client, "gguf-q4", "failed", metrics=metrics, gates={"max_kl": 0.15}).status_code == 201
    doc = page(client, "/ui/models/tiny/releases/1.0")
    assert cells(doc.find("tbody", data_artifact="gguf-q4"))[0] == {
        "ppl_change": "ungated",
        "kl": "fail",
        "top1": "ungated",
        "greedy_match": "ungated",
        "runtime": "llama.cpp",
        "verdict": "failed",
    }
    assert doc.find("td", data_metric="kl").text == "NaN ≤ 1.50e-01"
    assert doc.find("td", data_metric="greedy_match").text == "— no gate"


def test_metric_columns_cover_every_gate() -> None:
    assert sorted(c.gate for c in METRIC_COLUMNS) == sorted(GATE_KEYS)


def test_channel_history(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/channels/prod")
    assert doc.find("a", id="current").text == "2.0"
    rows = [[td.text for td in tr.find_all("td")][1:] for tr in doc.find("table", id="history").find_all("tr")[1:]]
    assert rows == [
        ["token:test-admin (release-bot)", "1.0 → 2.0", "forced", " ".join(FORCED_REASON.split())],
        ["token:test-admin (alice)", "(new) → 1.0", "no", ""],
    ]
    forced = doc.find("tr", class_="forced")
    assert forced.find_all("a")[0].attrs["href"] == "/ui/models/tiny/releases/1.0"


def test_audit_log_page(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/audit?model=tiny")
    failed = {"reason": FAILURES, "runtime": "llama.cpp"}
    overridden = json.dumps({"overridden_failures": [{"artifact": "gguf-q4_0", "failed": [failed]}]})
    rows = [[td.text for td in tr.find_all("td")][1:] for tr in doc.find("table", id="audit").find_all("tr")[1:]]
    rows = [row for row in rows if row[1] != "release.seal"]
    assert rows == [
        [
            "token:test-admin",
            "release.yank",
            "tiny@1.0",
            YANK_REASON,
            '{"yanked": false}',
            '{"yanked": true}',
            "",  # no channel named it any more: empty details are left out
        ],
        [
            "token:test-admin (release-bot)",
            "channel.promote.forced",
            "tiny/prod",
            " ".join(FORCED_REASON.split()),
            '{"version": "1.0"}',
            '{"evals_through": 6, "version": "2.0"}',
            overridden,
        ],
        [
            "token:test-admin (alice)",
            "channel.promote",
            "tiny/prod",
            "",
            '{"version": null}',
            '{"evals_through": 1, "version": "1.0"}',
            "",
        ],
    ]
    everything = page(client, "/ui/audit")
    assert {tr.attrs["data-action"] for tr in everything.find_all("tr") if tr.attrs} >= {"token.create", "release.yank"}


def test_errors_are_html_pages(client: TestClient) -> None:
    seed(client)
    for url, status, code, message in (
        ("/ui/models/nope", 404, "NOT_FOUND", "model 'nope' not found"),
        ("/ui/models/tiny/releases/9.9", 404, "NOT_FOUND", "release tiny@9.9 not found"),
        ("/ui/models/nope/releases/2.0", 404, "NOT_FOUND", "model 'nope' not found"),
        ("/ui/models/tiny/channels/staging", 404, "NOT_FOUND", "model 'tiny' has no channel 'staging'"),
        ("/ui/no/such/page", 404, "NOT_FOUND", "no page at /ui/no/such/page"),
        ("/ui/models/Not%20A%20Name", 422, "INVALID_INPUT", "invalid request: path.model: String should match"),
        ("/ui/audit?limit=0", 422, "INVALID_INPUT", "invalid request: query.limit"),
    ):
        doc = page(client, url, status)
        assert doc.find("code", id="error-code").text == code, url
        assert doc.find("p", id="error-message").text.startswith(message), url
    # The Hub-compatible downloads of a model named "ui" are not shadowed by the pages.
    hub = client.get("/ui/resolve/prod/model.gguf")
    assert hub.status_code == 404 and hub.headers["X-Error-Code"] == "RepoNotFound"


def test_pages_follow_the_read_rule(app: FastAPI, client: TestClient, settings: RegistrySettings) -> None:
    seed(client)
    pages = ["/", "/ui/", "/ui/models/tiny", "/ui/models/tiny/releases/2.0", "/ui/models/tiny/channels/prod"]
    pages += ["/ui/audit", "/ui/static/kiln.css", "/ui/elsewhere"]
    assert len(router.routes) + len(not_found_router.routes) == len(pages)  # every page is in the list above
    closed = create_app(settings.model_copy(update={"anonymous_read": False}))
    reader = make_token(closed, ["read"], name="reader")
    llama_only = make_token(closed, ["read"], models=["llama-*"], name="llama-only")
    with TestClient(closed) as bare:
        for url in pages:
            doc = page(bare, url, 401)
            assert doc.find("code", id="error-code").text == "UNAUTHORIZED"
            assert bare.get(url, headers={"Authorization": f"Bearer {reader}"}).status_code in (200, 404)
        # A token limited to other models is refused a model's pages, as by the API.
        as_llama = {"Authorization": f"Bearer {llama_only}"}
        for url in ("/ui/models/tiny", "/ui/models/tiny/releases/2.0", "/v1/models/tiny"):
            assert bare.get(url, headers=as_llama).status_code == 403, url
        assert bare.get("/ui/", headers=as_llama).status_code == 200
    with TestClient(app) as anonymous:
        assert anonymous.get("/ui/models/tiny/releases/2.0").status_code == 200  # anonymous read is on by default
