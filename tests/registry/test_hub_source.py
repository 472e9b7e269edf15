"""A recipe whose source is a hub repository (`hf://ORG/REPO@REVISION`), fetched from kiln's own registry (which
speaks the Hub protocol) on a loopback port: pinned to its commit, linked from the hub cache, never copied."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kiln.core.errors import KilnError
from kiln.pipeline import build
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.store import WorkDir
from tests.model_factory import make_model
from tests.registry.helpers import free_port, make_release, post_eval, publish, seal, serve_in_thread

ARTIFACT = "hf-bundle-bf16"


@pytest.fixture
def hub(app: FastAPI, client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The registry serving a tiny model's files as `kiln/tiny` at `1.0/hf-bundle-bf16`, as HF_ENDPOINT, with
    the hub cache in the test's directory."""
    model = make_model(tmp_path / "published")
    files = {p.name: p.read_bytes() for p in sorted(model.iterdir())}
    files["pytorch_model.bin"] = b"\x80\x04a pickle a repo ships beside its SafeTensors: never downloaded"
    make_release(client, planned=[ARTIFACT])
    publish(client, ARTIFACT, files, ["cpu"], quant="bf16", target="hf-bundle", format="safetensors")
    post_eval(client, ARTIFACT, "not_evaluated", reason="no evals in this test")
    seal(client)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with serve_in_thread(app) as port:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}"


def _recipe(root: Path, source: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "heldout.txt").write_text("held out text " * 200)
    recipe = {
        "model": "tiny",
        "version": "1.0.0",
        "source": source,
        "eval": {"text": "heldout.txt", "max_tokens": 256},
        "targets": [{"target": "gguf", "quants": ["f16"]}],
    }
    (root / "kiln.yaml").write_text(json.dumps(recipe))
    return root / "kiln.yaml"


def test_a_hub_source_is_pinned_to_its_commit_and_used_in_place(hub: str, client: TestClient, tmp_path: Path) -> None:
    recipe = load_recipe(_recipe(tmp_path / "r", f"hf://kiln/tiny@1.0/{ARTIFACT}"))
    commit = client.get(f"/v1/models/tiny/releases/1.0/artifacts/{ARTIFACT}").json()["manifest_digest"][:40]
    store = WorkDir(tmp_path / "work")
    ingest = build.plan(recipe, store)[0]
    snapshot = Path(ingest.args["source_dir"])
    assert snapshot.name == commit and snapshot.is_relative_to(tmp_path / "hub-cache")
    assert not (snapshot / "pytorch_model.bin").exists()  # only what kiln reads is downloaded
    out = LocalExecutor(store).run([ingest])["ingest/source"].output
    assert out is not None
    assert out.provenance["source"] == {
        "source": f"hf://kiln/tiny@1.0/{ARTIFACT}",
        "revision": f"1.0/{ARTIFACT}",
        "commit": commit,
        "endpoint": hub,
    }
    for f in out.files:  # the cache's blob itself, under a second name
        assert (out.files_dir / f.path).stat().st_ino == (snapshot / f.path).resolve().stat().st_ino
    # The same release from a directory or a hub: the same ingest output, so the same artifacts.
    local = build.plan(load_recipe(_recipe(tmp_path, "published")), store)[0]
    assert local.external == ingest.external
    assert LocalExecutor(WorkDir(tmp_path / "w2")).run([local])["ingest/source"].output.digest == out.digest  # type: ignore[union-attr]
    # Planned again: the snapshot is in the cache, the digests recorded; the ingest is cached.
    rows = {r.node: r for r in build.status(recipe, store)}
    assert rows["ingest/source"].state == "cached"


@pytest.mark.parametrize(
    ("source", "code"),
    [
        ("hf://kiln/nope@1.0/hf-bundle-bf16", "SOURCE_NOT_FOUND"),
        ("hf://kiln/tiny@9.9/hf-bundle-bf16", "SOURCE_NOT_FOUND"),
    ],
)
def test_a_hub_source_that_is_not_there_says_so(hub: str, tmp_path: Path, source: str, code: str) -> None:
    with pytest.raises(KilnError) as e:
        build.status(load_recipe(_recipe(tmp_path / "r", source)), WorkDir(tmp_path / "work"))
    assert e.value.code == code and source in e.value.message and e.value.details["endpoint"] == hub


def test_a_hub_that_does_not_answer_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    recipe = load_recipe(_recipe(tmp_path / "r", "hf://kiln/tiny@main"))
    with pytest.raises(KilnError) as e:
        build.status(recipe, WorkDir(tmp_path / "work"))
    assert e.value.code == "SOURCE_UNAVAILABLE" and "cannot be reached" in e.value.message


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("hf://kiln/tiny", "name the revision"),
        ("hf://kiln/tiny@", "name the revision"),
        ("hf://a/b/c@main", "ORG/REPO"),
        ("hf://../etc@main", "ORG/REPO"),
        ("hf://kiln/tiny@../../x", "is not a commit, tag or branch"),
    ],
)
def test_a_malformed_hub_source_is_a_recipe_error(tmp_path: Path, source: str, words: str) -> None:
    with pytest.raises(KilnError) as e:
        load_recipe(_recipe(tmp_path, source))
    assert e.value.code == "RECIPE_INVALID" and words in e.value.message
    assert e.value.details["errors"][0]["field"] == "source"
