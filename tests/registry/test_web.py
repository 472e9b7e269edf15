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
from tests.registry.pages import (
    DESCRIPTION,
    FAILURES,
    FILES,
    FORCED_REASON,
    HOSTILE_HOST,
    HOSTILE_LINEAGE,
    LLAMA_CPP,
    OLD_LLAMA_CPP,
    PROVENANCE,
    SOURCE_SHA,
    TRANSFORMERS,
    VLLM,
    YANK_REASON,
    Node,
    parse,
    seed,
)


def page(client: TestClient, url: str, status: int = 200) -> Node:
    response = client.get(url)
    assert response.status_code == status, response.text[:2000]
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    # Whatever the user wrote reaches the page as text, never as markup.
    assert "<script" not in response.text.lower() and "<b>" not in response.text
    return parse(response.text)


def cells(row: Node) -> dict[str, dict[str, str]]:
    """An artifact's row, per runtime group: the verdict ("—" where absent) and metric -> state."""
    groups: dict[str, dict[str, str]] = {}
    for td in row.find_all("td"):
        if "data-runtime" not in td.attrs:
            continue
        group = groups.setdefault(td.attrs["data-runtime"], {})
        if "absent" in td.classes:
            group["verdict"] = td.text
        elif "not-evaluated" in td.classes:
            group["verdict"] = "not evaluated"
        elif "verdict" in td.classes:
            group["verdict"] = td.find("span", class_="badge").text
        else:
            group[td.attrs["data-metric"]] = td.attrs["data-state"]
    return groups


ABSENT = {"verdict": "—"}


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


def test_release_page_is_the_artifact_by_runtime_matrix(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/2.0")
    assert doc.find("div", class_="scroll").find("table").attrs["id"] == "matrix"  # wide: it scrolls, not the page
    matrix = doc.find("table", id="matrix")
    top, metrics = matrix.find("thead").find_all("tr")
    # One column group per runtime: the reference first, vLLM beside it, llama.cpp with its variants, the rest.
    runtimes = ["transformers", "vllm", "llama.cpp", "llama.cpp-metal", "tensorrt_llm"]
    assert [c.attrs.get("data-runtime") for c in matrix.find_all("colgroup")] == [None, *runtimes, None]
    assert [th.text for th in top.find_all("th")] == [
        "Artifact",
        "Target",
        "Quant",
        "Size",
        "Runs on",
        f"transformers {TRANSFORMERS}",
        f"vllm {VLLM}",
        "llama.cpp versions differ: see each verdict",
        "llama.cpp-metal",
        "tensorrt_llm",
        "Files",
    ]
    assert [th.attrs["colspan"] for th in top.find_all("th", class_="runtime")] == ["5"] * 5
    group = ["Verdict", "Perplexity change", "KL divergence", "Top-1 agreement", "Greedy match"]
    assert [th.text for th in metrics.find_all("th")] == group * 5
    assert [th.attrs["data-runtime"] for th in metrics.find_all("th", class_="verdict")] == runtimes

    rows = {tr.attrs["data-artifact"]: tr for tr in matrix.find("tbody").find_all("tr")}
    assert list(rows) == ["gguf-q4_0", "gguf-q8_0", "hf-bundle-bf16", "trtllm-fp8"]  # one row per artifact
    assert {name: tr.attrs["data-status"] for name, tr in rows.items()} == {
        "gguf-q4_0": "failed",
        "gguf-q8_0": "passed",
        "hf-bundle-bf16": "passed",
        "trtllm-fp8": "not_evaluated",
    }

    q8 = rows["gguf-q8_0"]
    assert [b.text for b in q8.find_all("span", class_="hw")] == ["cpu", "apple"]
    assert q8.find("td", class_="num").text == "800 B"
    passed = {"ppl_change": "pass", "kl": "pass", "top1": "pass", "greedy_match": "ungated", "verdict": "passed"}
    assert cells(q8) == {
        "transformers": ABSENT,
        "llama.cpp": passed,
        "llama.cpp-metal": {"verdict": "not evaluated"},
        "vllm": ABSENT,
        "tensorrt_llm": ABSENT,
    }
    assert q8.find("td", data_metric="kl").text == "8.10e-05 ≤ 5.00e-03"
    assert "needs a runner with llama.cpp-metal" in q8.find("td", class_="not-evaluated").text
    # llama.cpp's versions differ between artifacts: each verdict says its own, the title too.
    verdict = q8.find("td", class_="verdict")
    assert verdict.text == f"passed {LLAMA_CPP}" and verdict.attrs["title"] == f"llama.cpp: {LLAMA_CPP}"
    absent = q8.find("td", class_="absent", data_runtime="vllm")
    assert absent.attrs["colspan"] == "5" and absent.text == "—"

    q4 = rows["gguf-q4_0"]
    assert cells(q4)["llama.cpp"] == {
        "ppl_change": "fail",
        "kl": "fail",
        "top1": "pass",
        "greedy_match": "ungated",
        "verdict": "failed",
    }
    assert q4.find("td", class_="verdict").text == f"failed {OLD_LLAMA_CPP} {FAILURES}"
    assert q4.find("td", data_metric="ppl_change").text == "+21.00% ≤ +15.00%"
    assert q4.find("td", data_metric="top1").text == "0.8600 ≥ 0.8000"

    # Two runtimes side by side on one row; their one version each is in the header, not repeated.
    bundle = rows["hf-bundle-bf16"]
    exact = {"ppl_change": "pass", "kl": "pass", "top1": "pass", "greedy_match": "ungated", "verdict": "passed"}
    assert cells(bundle) == {
        "transformers": exact,
        "llama.cpp": ABSENT,
        "llama.cpp-metal": ABSENT,
        "vllm": exact,
        "tensorrt_llm": ABSENT,
    }
    vllm = bundle.find("td", class_="verdict", data_runtime="vllm")
    assert vllm.text == "passed" and vllm.attrs["title"] == f"vllm: {VLLM}"
    assert bundle.find("td", data_runtime="transformers", data_metric="kl").text == "0.00e+00 ≤ 5.00e-03"

    # Not evaluated here: said so, with the runner it needs and why; never "passed".
    fp8 = rows["trtllm-fp8"]
    assert "passed" not in fp8.text
    assert fp8.find("td", class_="not-evaluated").text == (
        "not evaluated here: needs a runner with tensorrt_llm "
        "needs a runner with tensorrt_llm and an H100; this machine has neither"
    )
    assert fp8.find("td", class_="not-evaluated").attrs["colspan"] == "5"
    assert fp8.find("details", class_="unsupported").find("li").text == "a100 : FP8 tensor cores need sm89+"

    # Download links fetch the files.
    for name, files in FILES.items():
        links = rows[name].find_all("a", class_="download")
        assert sorted(a.text for a in links) == sorted(files)
        for a in links:
            assert a.attrs["href"].startswith("http://testserver/v1/models/tiny/releases/2.0/artifacts/")
            assert client.get(a.attrs["href"]).content == files[a.text]


def test_release_page_plots_quality_against_size(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/2.0")
    svg = doc.find("figure", id="quality-plot").find("svg", class_="quality-plot")
    marks = {(g.attrs["data-artifact"], g.attrs["data-runtime"]): g for g in svg.find_all("g", class_="mark")}
    # Every eval with metrics, none of the not_evaluated ones.
    assert sorted(marks) == [
        ("gguf-q4_0", "llama.cpp"),
        ("gguf-q8_0", "llama.cpp"),
        ("hf-bundle-bf16", "transformers"),
        ("hf-bundle-bf16", "vllm"),
    ]
    front = {key for key, g in marks.items() if "front" in g.classes}
    # vLLM's bf16 is as large as transformers' and further from the reference: off the front.
    assert front == {("gguf-q4_0", "llama.cpp"), ("gguf-q8_0", "llama.cpp"), ("hf-bundle-bf16", "transformers")}
    assert "failed" in marks["gguf-q4_0", "llama.cpp"].classes
    assert marks["hf-bundle-bf16", "transformers"].find("title").text == (
        "hf-bundle-bf16 · transformers · 3.9 KiB (4023 bytes) · KL 0 (drawn at 1e-07) · passed, on the Pareto front"
    )
    assert [e.attrs["data-runtime"] for e in svg.find_all("g", class_="legend-entry") if "data-runtime" in e.attrs] == [
        "transformers",
        "vllm",
        "llama.cpp",
    ]
    assert doc.find_all("p", id="not-plotted") == [] and doc.find_all("p", id="no-plot") == []


def test_release_page_shows_lineage_and_provenance_as_tables(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/2.0")
    lineage = doc.find("dl", class_="lineage")
    entries = dict(zip((dt.text for dt in lineage.find_all("dt")), lineage.find_all("dd"), strict=True))
    assert list(entries) == ["source_files", "built_by", "recipe.options.deep.deeper", "source", "steps"]
    files = entries["source_files"].find("table", class_="records")
    assert [th.text for th in files.find_all("th")] == ["path", "size", "sha256"]
    first = files.find("tbody").find_all("tr")[0]
    assert [td.text for td in first.find_all("td")] == ["model.safetensors", "3.0 GiB", SOURCE_SHA[:12] + "…"]
    assert first.find("code").attrs["title"] == SOURCE_SHA
    assert first.find("span").attrs["title"] == f"{3 * 1024**3} bytes"
    assert entries["built_by"].text == "kiln 0.1.0"
    assert entries["source"].text == HOSTILE_LINEAGE  # text, not markup (page() checks no <script>)
    assert entries["recipe.options.deep.deeper"].find("code").text == '{"deepest": 1}'
    assert entries["steps"].find("code").text == '[{"args": {"revision": "main"}, "name": "ingest"}]'

    # Provenance: per artifact that has one, collapsed, leading with where and how it was made.
    details = {d.attrs["data-artifact"]: d for d in doc.find_all("details", class_="provenance")}
    assert list(details) == sorted(FILES) and details["gguf-q8_0"].attrs["id"] == "provenance-gguf-q8_0"
    q8 = details["gguf-q8_0"]
    assert q8.find("summary").text == f"gguf-q8_0 stage export, on {HOSTILE_HOST}, 12.5 s"
    table = {tr.find("th").text: tr.find("td") for tr in q8.find("table", class_="kv").find_all("tr")}
    assert list(table)[:8] == list(PROVENANCE)[:8]
    assert table["cache_key"].find("code").attrs["title"] == "c" * 64
    assert table["host"].text == HOSTILE_HOST
    assert table["params.targets"].text == "gguf, hf-bundle"
    assert table["inputs.model.digest"].text == "f" * 12 + "…"
    assert details["gguf-q4_0"].find("summary").text == "gguf-q4_0 on test"  # the helper's default provenance
    link = doc.find("tr", data_artifact="gguf-q8_0").find("a", class_="provenance-link")
    assert link.attrs["href"] == "#provenance-gguf-q8_0"


def test_yanked_release_page_says_so(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/1.0")
    assert YANK_REASON in doc.find("p", id="yanked").text
    assert doc.find("tr", data_artifact="gguf-q8_0").attrs["data-status"] == "passed"
    assert doc.find_all("a", class_="download") == []  # a yanked release serves no file
    # Its one eval reported no metrics: nothing to plot, said so.
    assert doc.find_all("svg") == [] and "No eval of this release" in doc.find("p", id="no-plot").text
    assert [dt.text for dt in doc.find("dl", class_="lineage").find_all("dt")] == ["source"]


def test_open_release_page_says_what_is_missing(client: TestClient) -> None:
    seed(client)
    doc = page(client, "/ui/models/tiny/releases/3.0")
    banner = doc.find("p", id="open").text
    assert "1 of 2 planned artifacts" in banner and "missing: gguf-q4_0" in banner
    matrix = doc.find("table", id="matrix")
    assert [th.text for th in matrix.find("thead").find_all("th")] == [
        "Artifact",
        "Target",
        "Quant",
        "Size",
        "Runs on",
        "Evals",
        "Files",
    ]
    assert matrix.find("tr", data_artifact="gguf-q8_0").find("td", class_="not-evaluated").text == (
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
    assert cells(doc.find("tr", data_artifact="gguf-q4")) == {
        "llama.cpp": {
            "ppl_change": "ungated",
            "kl": "fail",
            "top1": "ungated",
            "greedy_match": "ungated",
            "verdict": "failed",
        }
    }
    assert doc.find("td", data_metric="kl").text == "NaN ≤ 1.50e-01"
    assert doc.find("td", data_metric="greedy_match").text == "— no gate"
    # A NaN has no place on a log scale: left out of the plot, and listed as such.
    assert doc.find_all("svg") == []
    assert doc.find("p", id="not-plotted").text == "not plotted: gguf-q4 (llama.cpp): KL divergence is NaN"


def test_unevaluated_artifact_spans_every_runtime_group(client: TestClient) -> None:
    make_release(client, planned=["a-eval", "b-none"])
    publish(client, "a-eval", {"a.gguf": b"a"}, ["cpu"])
    publish(client, "b-none", {"b.gguf": b"b"}, ["cpu"])
    gate = {"max_kl": 0.1}
    post_eval(client, "a-eval", "passed", metrics={"kl": 0.01}, gates=gate, runtime_version=LLAMA_CPP)
    post_eval(client, "a-eval", "passed", runtime="vllm", metrics={"kl": 0.02}, gates=gate)
    post_eval(client, "a-eval", "not_evaluated", runtime="tensorrt_llm@h100", reason="needs an H100 runner")
    doc = page(client, "/ui/models/tiny/releases/1.0")
    top = doc.find("table", id="matrix").find("thead").find_all("tr")[0]
    assert [th.attrs["data-runtime"] for th in top.find_all("th", class_="runtime")] == [
        "vllm",
        "llama.cpp",
        "tensorrt_llm@h100",
    ]
    none = doc.find("tr", data_artifact="b-none").find("td", class_="not-evaluated")
    assert none.attrs["colspan"] == "15" and none.text == "not evaluated no eval result was published for this artifact"
    # One recorded version and no other: the header says it; the one not recorded is not a difference.
    assert top.find("th", data_runtime="llama.cpp").text == f"llama.cpp {LLAMA_CPP}"
    assert top.find("th", data_runtime="vllm").text == "vllm"
    assert doc.find("svg", class_="quality-plot") is not None


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
            '{"evals_through": 7, "version": "2.0"}',
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
    gets = [r for r in [*router.routes, *not_found_router.routes] if "GET" in getattr(r, "methods", ())]
    assert len(gets) == len(pages)  # every page is in the list above (each also answers HEAD, as its twin)
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
