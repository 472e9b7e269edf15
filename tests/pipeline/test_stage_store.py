"""The shared stage store in a real S3 server (moto's server process): what one machine commits another
reads, a race for one key leaves one output, and what comes out of the bucket is checked before use."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kiln.core.errors import DigestMismatch, InvalidInput, KilnError, StageFailed
from kiln.pipeline.executors.node import run_node
from kiln.pipeline.store import RemoteStageStore, StageInputMissing, WorkDir, open_store, require_input
from tests.pipeline.ray_stages import toy
from tests.pipeline.test_stage_cache import kiln_build, small_recipe
from tests.registry.s3_server import TEST_ENV, S3Server


def _machine(s3: S3Server, url: str, root: Path) -> RemoteStageStore:
    return RemoteStageStore(url, WorkDir(root), endpoint_url=s3.endpoint_url)


def test_what_one_machine_commits_another_reads(s3_server: S3Server, tmp_path: Path) -> None:
    url = s3_server.new_url()
    a, b = _machine(s3_server, url, tmp_path / "a"), _machine(s3_server, url, tmp_path / "b")
    node = toy("x")
    made = run_node(a, node, {})
    assert made.status == "built" and made.output is not None and made.key is not None
    keys = s3_server.leftovers(url)
    assert f"{url.removeprefix('s3://kiln-test/')}/toy/{made.key}/stage.json" in keys
    assert len([k for k in keys if "/blobs/" in k]) == 1  # out.txt, by content
    assert b.digest(node, made.key) == made.output.digest and not (tmp_path / "b" / "toy").exists()
    found = b.lookup(node, made.key)  # materialised on b, verified
    assert found is not None and found.digest == made.output.digest
    assert (found.files_dir / "out.txt").read_bytes() == (made.output.files_dir / "out.txt").read_bytes()
    assert run_node(b, node, {}).status == "cached"
    after = run_node(b, toy("y", inputs={"a": "toy/x"}), {"a": found})
    assert after.status == "built"


def test_two_machines_finishing_one_key_leave_one_output(s3_server: S3Server, tmp_path: Path) -> None:
    url = s3_server.new_url()
    a, b = _machine(s3_server, url, tmp_path / "a"), _machine(s3_server, url, tmp_path / "b")
    node = toy("race")
    key = node.cache_key({})
    first = run_node(a, node, {})
    # b made the same key without seeing a's commit (its output differs: another record)
    tmp = b.new_temp("toy", key)
    (tmp / "files" / "out.txt").write_text("b's bytes")
    record = node.stage.record.model_validate({"value": "other", "upstream": []})
    second = b.commit(node, key, tmp, record, {"host": "b"})
    assert first.output is not None and second.digest == first.output.digest  # b adopted a's output
    assert (second.files_dir / "out.txt").read_bytes() == (first.output.files_dir / "out.txt").read_bytes()
    assert b.local.lookup(node, key).digest == first.output.digest  # type: ignore[union-attr]
    assert b"b's bytes" not in [
        s3_server.client.get_object(Bucket="kiln-test", Key=k)["Body"].read()
        for k in s3_server.leftovers(url)
        if k.endswith("stage.json")
    ]


def _put_stage_json(s3: S3Server, url: str, node_stage: str, key: str, body: bytes) -> None:
    prefix = url.removeprefix("s3://kiln-test/")
    s3.client.put_object(Bucket="kiln-test", Key=f"{prefix}/{node_stage}/{key}/stage.json", Body=body)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda m: b"{not json",
        lambda m: json.dumps({**m, "node": "toy/other"}).encode(),
        lambda m: json.dumps({**m, "key": "0" * 64}).encode(),
        lambda m: json.dumps({**m, "result": {"value": 1}}).encode(),
        lambda m: json.dumps({**m, "files": [{**m["files"][0], "path": "../../etc/passwd"}]}).encode(),
        lambda m: json.dumps({**m, "files": [{**m["files"][0], "path": "/abs"}]}).encode(),
        lambda m: json.dumps({**m, "files": m["files"] * 2}).encode(),
        lambda m: json.dumps({k: v for k, v in m.items() if k != "files"}).encode(),
        lambda m: json.dumps(m).encode()[:100],
        lambda m: b"",
        lambda m: bytes(range(256)) * 4,
        lambda m: json.dumps([m]).encode(),
        lambda m: json.dumps({**m, "files": {"out.txt": m["files"][0]}}).encode(),
        lambda m: json.dumps({k: v for k, v in m.items() if k != "provenance"}).encode(),
        lambda m: json.dumps({**m, "provenance": "deep"}).encode().replace(b'"deep"', b"[" * 5000 + b"]" * 5000),
    ],
    ids=[
        "not-json",
        "other-node",
        "other-key",
        "bad-record",
        "traversal",
        "absolute",
        "twice",
        "no-files",
        "truncated",
        "empty",
        "garbage",
        "list",
        "files-not-a-list",
        "no-provenance",
        "nested",
    ],
)
def test_a_stage_json_from_the_bucket_is_checked_before_use(
    mangle: object, s3_server: S3Server, tmp_path: Path
) -> None:
    url = s3_server.new_url()
    a, b = _machine(s3_server, url, tmp_path / "a"), _machine(s3_server, url, tmp_path / "b")
    node = toy("x")
    made = run_node(a, node, {})
    assert made.output is not None and made.key is not None
    meta = json.loads((made.output.path / "stage.json").read_text())
    _put_stage_json(s3_server, url, "toy", made.key, mangle(meta))  # type: ignore[operator]
    with pytest.raises(StageFailed) as e:
        b.lookup(node, made.key)
    assert e.value.code == "STAGE_STORE_CORRUPT"
    assert f"{url}/toy/{made.key}/stage.json" in e.value.message  # names the object
    with pytest.raises(StageFailed) as digest:
        b.digest(node, made.key)  # what planning a downstream key asks: the same error
    assert digest.value.code == "STAGE_STORE_CORRUPT"
    assert not list((tmp_path / "b").rglob("out.txt"))  # nothing materialised, no temporary left
    assert not list((tmp_path / "b").rglob(".tmp-*"))


def test_a_stage_json_naming_other_digests_than_its_blobs_is_refused(s3_server: S3Server, tmp_path: Path) -> None:
    url = s3_server.new_url()
    a = _machine(s3_server, url, tmp_path / "a")
    node = toy("x")
    made = run_node(a, node, {})
    assert made.output is not None and made.key is not None
    meta = json.loads((made.output.path / "stage.json").read_text())
    (entry,) = meta["files"]
    other = hashlib.sha256(b"x" * entry["size"]).hexdigest()  # a blob stored under that digest holds other bytes
    prefix = url.removeprefix("s3://kiln-test/")
    blob = f"{prefix}/blobs/{other[:2]}/{other[2:4]}/{other}"
    s3_server.client.put_object(Bucket="kiln-test", Key=blob, Body=b"y" * entry["size"])
    spoiled = json.dumps({**meta, "files": [{**entry, "sha256": other}]}).encode()
    _put_stage_json(s3_server, url, "toy", made.key, spoiled)
    with pytest.raises(DigestMismatch, match="out.txt"):
        _machine(s3_server, url, tmp_path / "b").lookup(node, made.key)
    assert not list((tmp_path / "b").rglob("out.txt"))


def test_a_corrupt_local_copy_is_set_aside_and_fetched_again(s3_server: S3Server, tmp_path: Path) -> None:
    url = s3_server.new_url()
    a = _machine(s3_server, url, tmp_path / "a")
    node = toy("x")
    made = run_node(a, node, {})
    assert made.output is not None and made.key is not None
    (made.output.path / "stage.json").write_bytes(b'{"truncated')
    again = run_node(_machine(s3_server, url, tmp_path / "a"), node, {})
    assert again.status == "cached" and again.output is not None and again.output.digest == made.output.digest
    assert len(list((tmp_path / "a" / "corrupt").iterdir())) == 1


def test_a_missing_or_altered_blob_is_refused(s3_server: S3Server, tmp_path: Path) -> None:
    url = s3_server.new_url()
    a = _machine(s3_server, url, tmp_path / "a")
    node = toy("x")
    made = run_node(a, node, {})
    assert made.output is not None and made.key is not None
    (entry,) = made.output.files
    blob_key = next(k for k in s3_server.leftovers(url) if k.endswith(entry.sha256))
    s3_server.client.put_object(Bucket="kiln-test", Key=blob_key, Body=b"altered in the bucket")
    with pytest.raises(DigestMismatch, match="out.txt"):
        _machine(s3_server, url, tmp_path / "b").lookup(node, made.key)
    s3_server.client.delete_object(Bucket="kiln-test", Key=blob_key)
    with pytest.raises(StageFailed) as e:
        _machine(s3_server, url, tmp_path / "c").lookup(node, made.key)
    assert e.value.code == "STAGE_STORE_CORRUPT" and "out.txt" in e.value.message
    assert not list(tmp_path.glob("[bc]/**/out.txt"))


def test_external_inputs_travel_by_digest_and_missing_inputs_name_their_key(
    s3_server: S3Server, tmp_path: Path
) -> None:
    url = s3_server.new_url()
    a, b = _machine(s3_server, url, tmp_path / "a"), _machine(s3_server, url, tmp_path / "b")
    text = tmp_path / "heldout.txt"
    text.write_text("held-out text")
    digest = hashlib.sha256(text.read_bytes()).hexdigest()
    a.put_external(text, digest)
    assert b.external(digest).read_text() == "held-out text"
    with pytest.raises(StageInputMissing):
        b.external("0" * 64)
    with pytest.raises(StageFailed, match="changed"):
        a.put_external(text, "1" * 64)  # the file is not what the plan hashed
    node = toy("never-built")
    with pytest.raises(StageInputMissing) as e:
        require_input(b, node, "ab" * 32)
    assert e.value.code == "STAGE_INPUT_MISSING" and "ab" * 32 in e.value.message
    with pytest.raises(InvalidInput) as bad:
        open_store("/some/dir", tmp_path)
    assert bad.value.code == "INVALID_STORE_URL"
    assert isinstance(open_store(None, tmp_path), WorkDir)


def test_an_unreachable_store_is_unavailable(tmp_path: Path) -> None:
    store = RemoteStageStore("s3://kiln-test/x", WorkDir(tmp_path), endpoint_url="http://127.0.0.1:9")
    with pytest.raises(KilnError) as e:
        store.lookup(toy("x"), "ab" * 32)
    assert e.value.code == "STAGE_STORE_UNAVAILABLE"


def test_kiln_build_stops_with_the_code_of_a_corrupt_stage_json_in_the_shared_store(
    s3_server: S3Server, tmp_path: Path
) -> None:
    url = s3_server.new_url()
    recipe = small_recipe(tmp_path)
    env = {**os.environ, **TEST_ENV, "KILN_S3_ENDPOINT_URL": s3_server.endpoint_url}
    first = kiln_build(recipe, tmp_path / "a", "--store", url, env=env)
    assert first.returncode == 0, first.stderr
    prefix = url.removeprefix("s3://kiln-test/")
    (key,) = [k for k in s3_server.leftovers(url) if k.startswith(f"{prefix}/export/") and k.endswith("stage.json")]
    body = s3_server.client.get_object(Bucket="kiln-test", Key=key)["Body"].read()
    s3_server.client.put_object(Bucket="kiln-test", Key=key, Body=body[: len(body) // 3])
    other = kiln_build(recipe, tmp_path / "b", "--store", url, env=env)  # another machine of the store
    assert other.returncode == 1
    assert "Traceback" not in other.stdout + other.stderr
    error = json.loads(other.stdout)["error"]
    assert error["code"] == "STAGE_STORE_CORRUPT" and f"s3://kiln-test/{key}" in error["message"]
