"""A release in a bucket (`source: s3://...`): planned from headers read with ranged GETs, ingested by
streaming, and the same ingest output, byte for byte, as the same release in a directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import KilnError, RecipeInvalid, SourceInvalid, UnsafeCheckpoint
from kiln.pipeline import build
from kiln.pipeline.recipe import parse_recipe
from kiln.pipeline.store import WorkDir, open_store
from tests.registry.s3_server import BUCKET, S3Server

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples/tiny-llama/model"
CONFIG = {name: (MODEL / name).read_bytes() for name in ("config.json", "tokenizer.json")}


def _upload(s3: S3Server, files: dict[str, bytes]) -> str:
    url = s3.new_url() + "/model"
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    for name, data in files.items():
        s3.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
    return url


def _recipe(tmp_path: Path, source: str) -> dict:  # type: ignore[type-arg]
    (tmp_path / "heldout.txt").write_text((ROOT / "examples/tiny-llama/heldout.txt").read_text()[:20000])
    return {
        "model": "tiny-llama",
        "version": "1.0.0",
        "source": source,
        "eval": {"text": "heldout.txt", "max_tokens": 256, "window": 128, "greedy_prompts": 1, "greedy_tokens": 4},
        "targets": [{"target": "gguf", "quants": ["f16"]}],
    }


@pytest.fixture
def endpoint(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    monkeypatch.setenv("KILN_S3_ENDPOINT_URL", s3_server.endpoint_url)
    return s3_server


def test_a_bucket_source_plans_from_headers_and_ingests_what_a_directory_does(
    endpoint: S3Server, tmp_path: Path
) -> None:
    url = _upload(endpoint, {p.name: p.read_bytes() for p in MODEL.iterdir() if p.is_file()})
    remote = parse_recipe(_recipe(tmp_path, url), base_dir=tmp_path)
    store = WorkDir(tmp_path / "work")
    nodes = build.plan(remote, store)
    mirror = next((tmp_path / "work" / build.SOURCES_DIR).iterdir())
    weights = mirror / "model.safetensors"
    # The mirror holds the header alone: the file has the model's size but (sparse) almost no blocks.
    assert weights.stat().st_size == (MODEL / "model.safetensors").stat().st_size > 10_000_000
    assert weights.stat().st_blocks * 512 < 1_000_000
    result = build.run(remote, store)
    assert [o.status for o in result.outcomes.values()].count("built") == len(nodes)

    local = parse_recipe(_recipe(tmp_path, str(MODEL)), base_dir=tmp_path, allowed_roots=[MODEL])
    here = build.run(local, WorkDir(tmp_path / "local"))
    for node_id in ("ingest/source", "export/gguf-f16", "eval/gguf-f16"):
        a, b = result.outcomes[node_id].output, here.outcomes[node_id].output
        assert a is not None and b is not None and a.digest == b.digest, node_id  # the same output


def test_an_object_changed_after_the_plan_is_refused(endpoint: S3Server, tmp_path: Path) -> None:
    files = {p.name: p.read_bytes() for p in MODEL.iterdir() if p.is_file()}
    url = _upload(endpoint, files)
    recipe = parse_recipe(_recipe(tmp_path, url), base_dir=tmp_path)
    store = open_store(None, tmp_path / "work")
    nodes = build.plan(recipe, store)
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    endpoint.client.put_object(Bucket=BUCKET, Key=f"{prefix}/config.json", Body=files["config.json"] + b" ")
    from kiln.pipeline.executors.local import LocalExecutor

    with pytest.raises(SourceInvalid) as e:
        LocalExecutor(store).run(nodes[:1])
    assert e.value.code == "SOURCE_CHANGED" and "config.json" in e.value.message
    assert not list((tmp_path / "work" / "ingest").glob("*/stage.json"))


@pytest.mark.parametrize(
    ("files", "error", "says"),
    [
        ({"pytorch_model.bin": b"\x80\x04not unpickled", "config.json": b"{}"}, UnsafeCheckpoint, "pickle"),
        ({"model.safetensors": (10**9).to_bytes(8, "little") + b"{}", **CONFIG}, SourceInvalid, "header"),
        ({"model.safetensors": (2).to_bytes(8, "little") + b"[]", **CONFIG}, SourceInvalid, "JSON object"),
    ],
    ids=["only-pickles", "header-past-the-end", "header-not-an-object"],
)
def test_a_bad_bucket_source_is_refused_at_plan_time(
    files: dict[str, bytes], error: type[KilnError], says: str, endpoint: S3Server, tmp_path: Path
) -> None:
    url = _upload(endpoint, files)
    with pytest.raises(error, match=says):
        build.plan(parse_recipe(_recipe(tmp_path, url), base_dir=tmp_path), WorkDir(tmp_path / "work"))


def test_a_recipe_source_is_a_prefix_not_a_bucket(tmp_path: Path) -> None:
    for bad in ("s3://kiln-test", "s3://Not_A_Bucket/m", "s3://kiln-test/../m"):
        with pytest.raises(RecipeInvalid, match="source"):
            parse_recipe(_recipe(tmp_path, bad), base_dir=tmp_path)
