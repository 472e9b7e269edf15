"""The web pages over plain HTTP, on SQLite and PostgreSQL: structure, escaping, links, errors, read access."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.eval.gates import GATE_KEYS
from kiln.registry.app import create_app
from kiln.registry.settings import RegistrySettings
from kiln.registry.web.routes import not_found_router, router
from kiln.registry.web.units import human_size
from kiln.registry.web.views import METRIC_COLUMNS
from tests.registry.conftest import make_token
from tests.registry.helpers import assert_error, make_release, post_eval, publish
from tests.registry.pages import (
    DESCRIPTION,
    FAILURES,
    FILES,
    FLEET,
    FLEET_MODEL,
    FORCED_REASON,
    FP8_RECORD,
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
    seed_fleet,
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
    pages += ["/ui/models/tiny/releases/2.0/fit?pool=cpu", "/ui/audit", "/ui/static/kiln.css", "/ui/elsewhere"]
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
        for url in (
            "/ui/models/tiny",
            "/ui/models/tiny/releases/2.0",
            "/ui/models/tiny/releases/2.0/fit",
            "/v1/models/tiny",
        ):
            assert bare.get(url, headers=as_llama).status_code == 403, url
        assert bare.get("/ui/", headers=as_llama).status_code == 200
    with TestClient(app) as anonymous:
        assert anonymous.get("/ui/models/tiny/releases/2.0").status_code == 200  # anonymous read is on by default
        assert anonymous.get("/ui/models/tiny/releases/2.0/fit").status_code == 200


# --- the fit explorer ----------------------------------------------------------------------------------------

FIT = f"/ui/models/{FLEET_MODEL}/releases/1.0/fit"
FLEET_QUERY: dict[str, Any] = {"pool": ["h100:8", "mi300x:8", "cpu"], "context": 8192, "concurrency": 4}


def fit(client: TestClient, status: int = 200, **params: Any) -> Node:
    return page(client, f"{FIT}?{urlencode(params, doseq=True)}", status)


def resolved(client: TestClient, hardware: str, **params: Any) -> list[dict[str, Any]]:
    """/v1/resolve's answer for the fleet's prod channel (release 1.0): the chosen candidate and its fallbacks."""
    response = client.get("/v1/resolve", params={"model": FLEET_MODEL, "hardware": hardware, **params})
    assert response.status_code == 200, response.text
    answer = response.json()
    return [answer, *answer["fallbacks"]]


def candidate_rows(doc: Node) -> list[Node]:
    return doc.find("table", id="candidates-table").find("tbody").find_all("tr", class_="candidate")


def test_fit_page_shows_resolves_ranking_with_its_numbers(app: FastAPI, client: TestClient) -> None:
    seed_fleet(app, client)
    doc = fit(client, **FLEET_QUERY)
    answer = resolved(client, "h100:8,mi300x:8,cpu", context=8192, concurrency=4)
    rows = candidate_rows(doc)
    # The ranking the API answers for the same release and query, candidate for candidate.
    assert [(r.attrs["data-hardware"], r.attrs["data-artifact"]) for r in rows] == [
        (c["hardware"], c["artifact"]["name"]) for c in answer
    ]
    assert [r.attrs["data-artifact"] for r in rows][:2] == ["hf-w4a16-awq", "hf-w4a16-awq"]
    for row, c in zip(rows, answer, strict=True):
        reason = c["reason"]
        tp = reason["tp"]
        assert int(row.attrs["data-tp"]) == tp and row.find("td", class_="tp").text.startswith(f"{tp} of ")
        assert row.attrs["data-fits"] == ("true" if reason["fits"] else "false")
        bar = row.find("svg", class_="membar")
        weights, kv = int(bar.attrs["data-weights-bytes"]), int(bar.attrs["data-kv-bytes"])
        # Per device: the replica's weights and KV cache over its TP (the KV heads split), as resolve sized them.
        assert weights == -(-reason["weights_bytes"] // tp) and weights + kv == reason["required_bytes"]
        assert kv == reason["kv_cache_bytes"] // tp
        assert int(bar.attrs["data-usable-bytes"]) == reason["usable_bytes"]
        assert int(bar.attrs["data-memory-bytes"]) == reason["memory_bytes"]
        memory = row.find("td", class_="memory")
        assert memory.find("span", class_="weights").text == human_size(weights)
        assert memory.find("span", class_="kv").text == human_size(kv)
        assert memory.find("strong", class_="required").text == human_size(reason["required_bytes"])
        assert memory.find("span", class_="usable").text == human_size(reason["usable_bytes"])
        # The figures the ranking ranked by, exactly, and as shown.
        assert float(row.attrs["data-decode"]) == reason["tokens_per_s_per_sequence"]
        assert float(row.attrs["data-ttft-ms"]) == reason["ttft_ms"]
        assert float(row.attrs["data-cost"]) == reason["cost_per_mtok"]
        decode = row.find("td", class_="decode")
        assert decode.text.startswith(f"{reason['tokens_per_s_per_sequence']:,.1f} ")
        assert f"{reason['tokens_per_s']:,.1f} per replica" in decode.text
        label = "measured" if reason["speed_source"] == "measured" else "spec"
        assert decode.find("span", class_="basis").attrs["data-basis"] == label
        assert row.find("td", class_="ttft").find("span", class_="basis").text == label
        assert row.find("td", class_="cost").text == f"${reason['cost_per_mtok']:,.2f}"
        assert row.find("details", class_="explanation").find_all("p")[1].text == " ".join(
            reason["explanation"].split()
        )
    # hf-fp8 on two H100s was measured at 8K × 4: its figures are the record's, labelled so, its bound beside.
    fp8 = doc.find("tr", data_artifact="hf-fp8", data_hardware="h100")
    record = next(c["reason"] for c in answer if c["artifact"]["name"] == "hf-fp8")
    assert record["speed_source"] == "measured" and record["measured"]["tokens_per_s"] == FP8_RECORD["tokens_per_s"]
    assert fp8.find("td", class_="ttft").text == "612 ms measured"
    # The API's bound is the replica's, four sequences a step: the page's is one sequence's.
    assert fp8.find("div", class_="bound").text == f"bound {record['decode_tokens_per_s_bound'] / 4:,.1f} (spec)"
    assert (
        "measured by vLLM 0.32.0, CUDA 12.8 on h100 (TP 2, context 8192 × 4)"
        in fp8.find("p", class_="basis-detail").text
    )
    assert {r.find("td", class_="ttft").find("span").attrs["data-basis"] for r in rows if r is not fp8} == {"spec"}

    # The chosen one, in resolve's words, and why each other lost, from their own figures.
    first = answer[0]
    banner = doc.find("p", id="answer")
    assert banner.find_all("strong")[0].text == first["artifact"]["name"] == "hf-w4a16-awq"
    explanation = first["explanation"]
    assert banner.find("span", class_="explanation").text == explanation[0].upper() + explanation[1:] + "."
    verdicts = {
        (r.attrs["data-artifact"], r.attrs["data-hardware"]): r.find("span", class_="verdict").text for r in rows
    }
    best = first["reason"]["tokens_per_s_per_sequence"]
    assert verdicts["hf-w4a16-awq", "mi300x"] == "chosen"
    bf16 = next(c["reason"] for c in answer if (c["artifact"]["name"], c["hardware"]) == ("hf-bf16", "h100"))
    assert verdicts["hf-bf16", "h100"] == (
        f"slower: {bf16['tokens_per_s_per_sequence']:,.1f} tokens/s per sequence, against {best:,.1f}"
    )
    q8 = next(c["reason"] for c in answer if c["artifact"]["name"] == "gguf-q8_0")
    assert not q8["fits"]
    assert verdicts["gguf-q8_0", "cpu"] == (
        f"does not fit in 1 device: at TP 1 it needs {human_size(q8['required_bytes'])} per device "
        f"(weights {human_size(q8['weights_bytes'])} + KV cache {human_size(q8['kv_cache_bytes'])}) "
        f"of {human_size(q8['usable_bytes'])} usable"
    )
    assert doc.find("tr", class_="candidate", data_artifact="gguf-q8_0").find("svg").attrs["class"] == "membar over"
    # Left out: the artifacts not built for a pool, and the one whose eval failed, with the failure.
    left = {tr.attrs["data-artifact"]: tr for tr in doc.find("table", id="unranked").find("tbody").find_all("tr")}
    assert left["gguf-q2_k"].attrs["class"] == "eval-failed" and left["gguf-q2_k"].attrs["data-hardware"] == "cpu"
    assert left["gguf-q2_k"].find("td", class_="why").text == "eval failed llama.cpp: kl 0.48 is above max_kl 0.1"
    assert left["hf-bf16"].attrs["data-hardware"] == "cpu" and left["hf-bf16"].find("td", class_="why").text == (
        "not built for it"
    )
    assert left["gguf-q4_k_m"].attrs["data-hardware"] == "h100,mi300x"


def test_fit_page_policies_and_the_form(app: FastAPI, client: TestClient) -> None:
    seed_fleet(app, client)
    for policy in ("cost", "quality"):
        doc = fit(client, **FLEET_QUERY, policy=policy, kv_cache_dtype="fp8")
        answer = resolved(
            client, "h100:8,mi300x:8,cpu", context=8192, concurrency=4, policy=policy, kv_cache_dtype="fp8"
        )
        rows = candidate_rows(doc)
        assert [(r.attrs["data-hardware"], r.attrs["data-artifact"]) for r in rows] == [
            (c["hardware"], c["artifact"]["name"]) for c in answer
        ]
        for row, c in zip(rows, answer, strict=True):
            assert int(row.find("svg").attrs["data-kv-bytes"]) == c["reason"]["kv_cache_bytes"] // c["reason"]["tp"]
    # Quality: lowest KL first (bf16's 0: on h100 at TP 2 and on mi300x at TP 1, the faster chosen); then the others
    # by KL, whatever their speed; Q8_0 (KL 0.004) does not fit on the CPU, which is what it is told.
    verdicts = [r.find("span", class_="verdict").text for r in rows]
    assert [r.attrs["data-artifact"] for r in rows[:3]] == ["hf-bf16", "hf-bf16", "hf-fp8"]
    assert verdicts[0] == "chosen"
    assert verdicts[1].startswith("slower: ") and verdicts[1].endswith(" tokens/s per sequence, against 38.9")
    assert verdicts[2] == "further from the reference: KL 0.011, against 0"
    assert verdicts[-1].startswith("does not fit in 1 device: at TP 1 it needs 74.8 GiB per device")
    # The form says what was asked, with room for another pool; the other settings are selected.
    form = doc.find("form", class_="fit-form")
    assert form.attrs["action"] == FIT and form.attrs["method"] == "get"
    assert [i.attrs["value"] for i in form.find_all("input", name="pool")] == ["h100:8", "mi300x:8", "cpu", ""]
    assert form.find("input", name="context").attrs["value"] == "8192"
    assert form.find("option", value="quality").attrs.get("selected") == ""
    assert form.find("option", value="fp8").attrs.get("selected") == ""
    assert {o.attrs["value"] for o in form.find("datalist", id="skus").find_all("option")} >= {"h100", "mi300x", "cpu"}


def test_fit_page_labels_bounds_on_measured_shares(app: FastAPI, client: TestClient) -> None:
    """On h200, whose catalog entry carries measured shares of its peaks, the bounds are labelled "measured share"
    and say where the shares were measured; on h100 (none measured) "spec"; the record's figures "measured"."""
    seed_fleet(app, client)
    doc = fit(client, pool=["h200:8", "h100:8"], context=8192, concurrency=4)
    answer = resolved(client, "h200:8,h100:8", context=8192, concurrency=4)
    rows = candidate_rows(doc)
    assert [(r.attrs["data-hardware"], r.attrs["data-artifact"]) for r in rows] == [
        (c["hardware"], c["artifact"]["name"]) for c in answer
    ]
    for row, c in zip(rows, answer, strict=True):
        reason = c["reason"]
        decode = row.find("td", class_="decode").find("span", class_="basis")
        ttft = row.find("td", class_="ttft").find("span", class_="basis")
        if reason["speed_source"] == "measured":
            expected = ("measured", "measured")
        else:
            basis = reason["basis"]
            expected = (
                "measured share" if basis["decode"] == "measured" else "spec",
                "measured share" if basis["prefill"] == "measured" else "spec",
            )
        assert (decode.text, ttft.text) == expected, (c["hardware"], c["artifact"]["name"])
        detail = row.find("p", class_="basis-detail").text
        if c["hardware"] == "h200":
            assert expected == ("measured share", "measured share")
            assert reason["basis"]["source"] in detail
        else:
            assert reason["basis"]["source"] is None


def test_fit_page_defaults_to_the_pools_the_release_is_built_for(app: FastAPI, client: TestClient) -> None:
    seed_fleet(app, client)
    doc = page(client, FIT)
    # The catalog's order; no free-device limit (a whole node each); resolve's defaults for the rest.
    form = doc.find("form", class_="fit-form")
    assert [i.attrs["value"] for i in form.find_all("input", name="pool")] == ["cpu", "h100", "mi300x", ""]
    assert doc.find("p", id="defaulted") is not None
    answer = resolved(client, "cpu,h100,mi300x")
    assert [(r.attrs["data-hardware"], r.attrs["data-artifact"]) for r in candidate_rows(doc)] == [
        (c["hardware"], c["artifact"]["name"]) for c in answer
    ]
    # Linked from the release page; the same query on another release is one link away.
    release = page(client, f"/ui/models/{FLEET_MODEL}/releases/1.0")
    assert release.find("a", id="fit-link").attrs["href"] == FIT


def test_fit_page_shows_what_it_can_when_nothing_fits(app: FastAPI, client: TestClient) -> None:
    seed_fleet(app, client)
    # 128K × 4 on the CPU: 40 GiB of KV cache alone, on top of the weights.
    api = client.get(
        "/v1/resolve", params={"model": FLEET_MODEL, "hardware": "cpu", "context": 131072, "concurrency": 4}
    )
    error = assert_error(api, 404, "NO_COMPATIBLE_ARTIFACT")
    doc = fit(client, pool="cpu", context=131072, concurrency=4)
    assert doc.find_all("p", id="answer") == []
    problem = doc.find("p", id="problem")
    assert problem.find("code", id="problem-code").text == "NO_COMPATIBLE_ARTIFACT"
    assert problem.text.endswith(error["message"].replace(" (channel prod)", "").split(": ", 1)[1])
    rows = candidate_rows(doc)
    assert [(r.attrs["data-artifact"], int(r.attrs["data-tp"])) for r in rows] == [
        (c["artifact"], c["tp"]) for c in error["details"]["candidates"]
    ]
    for row, c in zip(rows, error["details"]["candidates"], strict=True):
        bar = row.find("svg")
        assert int(bar.attrs["data-weights-bytes"]) + int(bar.attrs["data-kv-bytes"]) == c["required_bytes"]
        assert row.find("span", class_="verdict").text.startswith("does not fit in 1 device: at TP 1 it needs")
        assert row.attrs["data-fits"] == "false"

    # Too few free devices: bf16 needs two H100s, the pool has one.
    doc = fit(client, pool="h100:1", context=8192, concurrency=4)
    bf16 = doc.find("tr", data_artifact="hf-bf16")
    assert bf16.find("span", class_="verdict").text == (
        "does not fit in 1 device: at TP 1 it needs 141.4 GiB per device (weights 131.4 GiB + KV cache 10.0 GiB) "
        "of 72.0 GiB usable; the pool has 1 free"
    )
    assert doc.find("p", id="answer").find_all("strong")[0].text == "hf-w4a16-awq"

    # A pool with no free device: each replica fits a node, and has no room in the pool.
    doc = fit(client, pool="h100:0", context=8192, concurrency=4)
    assert doc.find("code", id="problem-code").text == "NO_COMPATIBLE_ARTIFACT"
    awq = doc.find("tr", class_="candidate", data_artifact="hf-w4a16-awq")
    assert awq.find("span", class_="verdict").text == "needs TP 1; the pool has 0 free devices"
    assert awq.find("svg").attrs["class"] == "membar"  # its memory fits: the bar is not red

    # An SLO nothing meets: SLO_UNMET, every candidate with what it misses.
    doc = fit(client, **FLEET_QUERY, min_tokens_per_s=500)
    assert doc.find("code", id="problem-code").text == "SLO_UNMET"
    verdicts = [r.find("span", class_="verdict").text for r in candidate_rows(doc)]
    assert all(v.startswith(("misses the SLO: ", "does not fit")) for v in verdicts), verdicts
    assert verdicts[0].startswith("misses the SLO: 105.5 < 500 tokens/s per sequence")
    assert doc.find("input", name="min_tokens_per_s").attrs["value"] == "500"
    exact = fit(client, **FLEET_QUERY, max_ttft_ms=1234.5678)  # the form gives back what was asked, to the digit
    assert exact.find("input", name="max_ttft_ms").attrs["value"] == "1234.5678"

    # A pool nothing is built for: nothing to rank, every artifact left out with why.
    doc = fit(client, pool="tpu-v5e")
    assert doc.find("code", id="problem-code").text == "NO_COMPATIBLE_ARTIFACT"
    assert doc.find_all("table", id="candidates-table") == []
    left = doc.find("table", id="unranked").find("tbody").find_all("tr")
    assert [tr.attrs["data-artifact"] for tr in left] == sorted(FLEET)
    assert {tr.find("td", class_="why").text for tr in left} == {"not built for it"}


def test_fit_page_of_releases_not_served(client: TestClient) -> None:
    seed(client)
    open_release = page(client, "/ui/models/tiny/releases/3.0/fit")
    assert "resolve answers only with sealed releases" in open_release.find("p", id="not-served").text
    assert [r.attrs["data-artifact"] for r in candidate_rows(open_release)] == ["gguf-q8_0"]
    yanked = page(client, "/ui/models/tiny/releases/1.0/fit")
    assert "resolve never answers with this release" in yanked.find("p", id="not-served").text
    served = page(client, "/ui/models/tiny/releases/2.0/fit?pool=cpu")
    assert served.find_all("p", id="not-served") == []
    # The other releases of the model, each with the same query.
    links = {a.text: a.attrs["href"] for a in served.find("p", id="other-releases").find_all("a")}
    assert links == {
        v: f"/ui/models/tiny/releases/{v}/fit?pool=cpu&context=4096&concurrency=1&policy=latency&kv_cache_dtype=bf16"
        for v in ("3.0", "1.0")
    }
    # Pools that were the release's defaults are not carried to another release: it has its own.
    defaulted = page(client, "/ui/models/tiny/releases/2.0/fit?context=8192")
    hrefs = [a.attrs["href"] for a in defaulted.find("p", id="other-releases").find_all("a")]
    assert hrefs[0] == "/ui/models/tiny/releases/3.0/fit?context=8192&concurrency=1&policy=latency&kv_cache_dtype=bf16"
    # An artifact whose eval failed is never ranked; tiny's model_config has no parameter count: TTFT unknown.
    assert served.find("tr", data_artifact="gguf-q4_0").attrs["class"] == "eval-failed"
    assert (
        served.find("tr", class_="candidate", data_artifact="gguf-q8_0")
        .find("td", class_="ttft")
        .text.startswith("unknown")
    )


def test_fit_page_refuses_bad_input_with_an_html_error(app: FastAPI, client: TestClient) -> None:
    seed_fleet(app, client)
    for params, status, code, message in (
        ({"pool": "h999"}, 422, "UNKNOWN_NAME", "unknown hardware 'h999'; known: "),
        ({"pool": "h100:x"}, 422, "RESOLVE_POOLS_INVALID", "hardware 'h100:x': free devices must be a whole number"),
        ({"pool": "H100"}, 422, "RESOLVE_POOLS_INVALID", "hardware 'H100': expected an SKU name"),
        ({"pool": ["h100", "h100:2"]}, 422, "RESOLVE_POOLS_INVALID", "hardware 'h100' is listed twice"),
        ({"pool": [f"h{i}" for i in range(17)]}, 422, "RESOLVE_POOLS_INVALID", "at most 16 hardware pools"),
        ({"pool": "h" * 1001}, 422, "RESOLVE_POOLS_INVALID", "the pools are over 1000 characters"),
        ({"context": 0}, 422, "INVALID_INPUT", "invalid request: query.context"),
        ({"context": 10**8}, 422, "INVALID_INPUT", "invalid request: query.context"),
        ({"context": "8k"}, 422, "INVALID_INPUT", "invalid request: query.context"),
        ({"concurrency": -1}, 422, "INVALID_INPUT", "invalid request: query.concurrency"),
        ({"policy": "fastest"}, 422, "INVALID_INPUT", "invalid request: query.policy"),
        ({"kv_cache_dtype": "fp4"}, 422, "INVALID_INPUT", "invalid request: query.kv_cache_dtype"),
        ({"min_tokens_per_s": "lots"}, 422, "INVALID_INPUT", "invalid request: query.min_tokens_per_s"),
        ({"max_ttft_ms": "inf"}, 422, "INVALID_INPUT", "invalid request: query.max_ttft_ms"),
        ({"max_ttft_ms": -5}, 422, "INVALID_INPUT", "invalid request: query.max_ttft_ms"),
    ):
        doc = fit(client, status, **params)
        assert doc.find("code", id="error-code").text == code, params
        assert doc.find("p", id="error-message").text.startswith(message), (params, doc.find("p", id="error-message"))
    for url, code, message in (
        (f"/ui/models/{FLEET_MODEL}/releases/9.9/fit", "NOT_FOUND", f"release {FLEET_MODEL}@9.9 not found"),
        ("/ui/models/nope/releases/1.0/fit?pool=h100", "NOT_FOUND", "model 'nope' not found"),
    ):
        doc = page(client, url, 404)
        assert (doc.find("code", id="error-code").text, doc.find("p", id="error-message").text) == (code, message)
    # A GET form sends its empty fields: an empty SLO field or pool is the parameter left out.
    blank = fit(client, pool=["h100:8", "", "  "], min_tokens_per_s="", max_ttft_ms="", context=8192, concurrency=4)
    assert {r.attrs["data-hardware"] for r in candidate_rows(blank)} == {"h100"}
    # A long list of pool fields is refused as fast as a short one.
    started = time.perf_counter()
    fit(client, 422, pool=["h100"] * 2000)
    assert time.perf_counter() - started < 2.0


def test_fit_page_is_read_as_the_api_behind_it(app: FastAPI, client: TestClient, settings: RegistrySettings) -> None:
    """Every kind of caller gets the fit page exactly when it may read the release through the API."""
    seed_fleet(app, client)
    closed = create_app(settings.model_copy(update={"anonymous_read": False}))
    tokens = {
        "read": make_token(closed, ["read"], name="reader"),
        "this-reader": make_token(closed, ["read"], models=["llama-*"], name="llama-reader"),
        "other-reader": make_token(closed, ["read"], models=["tiny-*"], name="tiny-reader"),
        "publish": make_token(closed, ["publish"], name="publisher"),
        "this-admin": make_token(closed, ["admin"], models=["llama-*"], name="llama-admin"),
        "other-admin": make_token(closed, ["admin"], models=["tiny-*"], name="tiny-admin"),
        "admin": make_token(closed, ["admin"], name="root"),
    }
    expected = {
        "anonymous": 401,
        "read": 200,
        "this-reader": 200,
        "other-reader": 403,
        "publish": 200,  # publish implies read
        "this-admin": 200,
        "other-admin": 403,
        "admin": 200,
    }
    api = f"/v1/models/{FLEET_MODEL}/releases/1.0"
    url = f"{FIT}?pool=h100:8&pool=cpu"
    with TestClient(closed) as bare:
        for caller, status in expected.items():
            headers = {"Authorization": f"Bearer {tokens[caller]}"} if caller in tokens else {}
            assert bare.get(api, headers=headers).status_code == status, caller
            response = bare.get(url, headers=headers)
            assert response.status_code == status, (caller, response.text[:300])
            assert response.headers["content-type"] == "text/html; charset=utf-8"
            if status != 200:
                code = parse(response.text).find("code", id="error-code").text
                assert code == ("UNAUTHORIZED" if status == 401 else "FORBIDDEN"), caller
            else:
                assert parse(response.text).find("p", id="answer").find_all("strong")[0].text == "hf-w4a16-awq"
    with TestClient(app) as anonymous:  # anonymous read, the default: the page too
        assert anonymous.get(url).status_code == 200
