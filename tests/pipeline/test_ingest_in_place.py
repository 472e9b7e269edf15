"""Ingest keeps no second copy of the weights, and `kiln plan` reads none of them.

The source is linked into the store (a reflink, else a hard link, else a symbolic link to it in place), hashed
once, and checked: a source that changed after the plan is refused (SOURCE_CHANGED, naming the file), one
edited in place after ingest is never served as what was hashed. `kiln plan` plans from config.json, the
headers and the digests an earlier ingest recorded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.core import digest as core_digest
from kiln.core.digest import HashCache
from kiln.core.errors import KilnError
from kiln.formats.hf_model import open_source
from kiln.pipeline import build
from kiln.pipeline.executors.local import LocalExecutor
from kiln.pipeline.recipe import load_recipe
from kiln.pipeline.records import IngestRecord
from kiln.pipeline.stage import StageOutput
from kiln.pipeline.stages import ingest as ingest_stage
from kiln.pipeline.store import RemoteStageStore, WorkDir
from tests.pipeline.test_stage_cache import small_recipe
from tests.registry.s3_server import S3Server


def _ingest(src: Path, work: Path, *, copy: bool = False) -> StageOutput:
    hashes = HashCache(work / build.HASH_CACHE)
    node = ingest_stage.node(open_source(src, hasher=hashes.sha256), src, work / build.HASH_CACHE, copy=copy)
    hashes.save()
    out = LocalExecutor(WorkDir(work)).run([node])["ingest/source"].output
    assert out is not None
    return out


def _other_filesystem(tmp_path: Path) -> Path:
    """A directory on another filesystem than `tmp_path` (tmpfs), where no hard link can reach."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK) or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no writable directory on another filesystem")
    return shm


def test_ingest_links_the_source_and_stores_no_second_copy(tmp_path: Path) -> None:
    recipe = small_recipe(tmp_path)
    src = tmp_path / "model"
    out = _ingest(src, tmp_path / "work")
    for f in out.record(IngestRecord).source_files:
        stored, original = out.files_dir / f.path, src / f.path
        assert not stored.is_symlink()
        # One inode, two names (this ext4 has no reflinks; a filesystem that has them clones instead).
        assert stored.stat().st_ino == original.stat().st_ino and stored.stat().st_nlink == 2
    # Copied on request: other bytes on disk, the same output (so every later stage keys the same).
    copied = _ingest(src, tmp_path / "copy", copy=True)
    assert all((copied.files_dir / f.path).stat().st_nlink == 1 for f in copied.files)
    assert copied.digest == out.digest and copied.files == out.files
    # A build re-uses the linked ingest: the source's digests stayed recorded through the link.
    store = WorkDir(tmp_path / "work")
    rows = {r.node: r for r in build.status(load_recipe(recipe), store)}
    assert rows["ingest/source"].state == "cached" and rows["ingest/source"].key == out.key


def test_a_source_on_another_filesystem_is_referenced_in_place_and_shared_as_bytes(
    s3_server: S3Server, tmp_path: Path
) -> None:
    from tests.model_factory import make_model

    src = make_model(Path(_other_filesystem(tmp_path)) / f"kiln-src-{os.getpid()}-{tmp_path.name}")
    try:
        url = s3_server.new_url()
        here = RemoteStageStore(url, WorkDir(tmp_path / "a"), endpoint_url=s3_server.endpoint_url)
        hashes = HashCache(tmp_path / "a" / build.HASH_CACHE)
        node = ingest_stage.node(open_source(src, hasher=hashes.sha256), src, tmp_path / "a" / build.HASH_CACHE)
        hashes.save()
        out = LocalExecutor(here).run([node])["ingest/source"].output
        assert out is not None
        for f in out.files:
            assert (out.files_dir / f.path).is_symlink() and (out.files_dir / f.path).resolve() == src / f.path
        assert here.local.lookup(node, out.key) is not None  # verified by content through the link
        opened = ingest_stage.open_ingested(out)
        assert set(opened.tensors) == set(open_source(src).tensors)
        # Another machine gets the bytes, as plain files.
        there = RemoteStageStore(url, WorkDir(tmp_path / "b"), endpoint_url=s3_server.endpoint_url)
        fetched = there.lookup(node, out.key)
        assert fetched is not None and fetched.digest == out.digest
        for f in fetched.files:
            path = fetched.files_dir / f.path
            assert not path.is_symlink() and path.read_bytes() == (src / f.path).read_bytes()
    finally:
        for p in src.iterdir():
            p.unlink()
        src.rmdir()


def test_a_source_changed_since_the_plan_is_refused_naming_the_file(tmp_path: Path) -> None:
    small_recipe(tmp_path)
    src = tmp_path / "model"
    hashes = HashCache(tmp_path / "hashes.json")
    node = ingest_stage.node(open_source(src, hasher=hashes.sha256), src, tmp_path / "hashes.json")
    hashes.save()
    config = src / "config.json"
    config.write_text(config.read_text().replace("{", '{"edited": true, ', 1))
    with pytest.raises(KilnError) as e:
        LocalExecutor(WorkDir(tmp_path / "work")).run([node])
    assert e.value.code == "SOURCE_CHANGED" and e.value.details["files"] == ["config.json"]
    assert "config.json changed since the build was planned" in e.value.message
    assert not list((tmp_path / "work").glob("ingest/*/stage.json"))


def test_a_source_edited_in_place_after_ingest_is_not_served(tmp_path: Path) -> None:
    recipe = small_recipe(tmp_path)
    src, work = tmp_path / "model", tmp_path / "work"
    first = build.plan(load_recipe(recipe), WorkDir(work))[0]
    out = LocalExecutor(WorkDir(work)).run([first])["ingest/source"].output
    assert out is not None
    weights = src / "model.safetensors"
    with open(weights, "r+b") as f:  # the last byte of the last tensor, rewritten in place (same size)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    # The hard-linked output changed with it: the store finds it is not what it hashed, and drops it.
    assert WorkDir(work).lookup(first, out.key) is None
    assert list((work / "corrupt").iterdir())
    # The next plan hashes the edited source again: another key, an ingest of what the source now is.
    again = build.plan(load_recipe(recipe), WorkDir(work))[0]
    assert again.external["source"] != first.external["source"]
    made = LocalExecutor(WorkDir(work)).run([again])["ingest/source"].output
    assert made is not None and made.digest != out.digest


def test_kiln_plan_reads_no_weights_and_uses_the_digests_ingest_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = load_recipe(small_recipe(tmp_path))
    store = WorkDir(tmp_path / "work")
    read: list[str] = []
    hash_file = core_digest.sha256_file

    def counting(path: str | Path) -> str:
        read.append(Path(path).name)
        return hash_file(path)

    monkeypatch.setattr(core_digest, "sha256_file", counting)
    rows = {r.node: r for r in build.status(recipe, store)}
    assert not [n for n in read if n.endswith(".safetensors")], read  # the held-out text, nothing of the model
    ingest = rows["ingest/source"]
    assert ingest.key is None and ingest.state == "to build" and "hashed once, at ingest" in (ingest.reason or "")
    assert "model.safetensors" in (ingest.reason or "")
    assert all(r.key is None for r in rows.values())  # nothing after an unhashed ingest has a key either

    # A build hashes the source once; the ingest links it (no second read), and records the digests.
    read.clear()
    nodes = build.plan(recipe, store)
    LocalExecutor(store).run(nodes[:1])
    assert read.count("model.safetensors") == 1
    read.clear()
    rows = {r.node: r for r in build.status(recipe, store)}
    assert not [n for n in read if n.endswith(".safetensors")], read
    assert rows["ingest/source"].state == "cached" and rows["ingest/source"].key is not None
    assert rows["reference/source"].key is not None  # keyed by the stored ingest's digest
