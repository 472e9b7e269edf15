"""A release's source in object storage (`source: s3://bucket/prefix` in the recipe), planned from headers.

Planning a build needs the model's config, tokenizer and every tensor's dtype, shape and place, never
its weights. `S3Source.mirror` makes a local *header mirror* of the prefix: the small files (config,
tokenizer, the SafeTensors index) downloaded whole, and each SafeTensors file as a sparse file of its
real size holding only its header, read with two ranged GETs (the 8-byte length, then the header).
`formats.hf_model.open_source` then checks the mirror exactly as it checks a local directory (strict
headers, the data buffer covered exactly, names and shapes against config.json, pickles refused or
left alone), and the plan is made from it: a 140 GB release costs a few MB of requests and no disk.

The key of the ingest stage is made of the objects' listing (name, size, ETag): what the plan can
know without reading the weights. The ingest stage then streams each file the plan uses into the
store with ranged GETs (bounded memory), refuses any object whose size or ETag changed since the
plan, checks the downloaded copy like any local source, and records its sha256 digests, so every
later stage keys on content, as with a local source: the same release from a directory or a bucket
gives the same ingest output and the same artifacts.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.digest import sha256_json
from kiln.core.error_codes import Codes
from kiln.core.errors import SourceInvalid, Unavailable
from kiln.core.manifest import check_relative_path
from kiln.formats.hf_model import CONFIG_FILES, INDEX_FILE, MAX_INDEX_BYTES, TOKENIZER_FILES
from kiln.formats.safetensors import MAX_HEADER_BYTES

SMALL_FILES = frozenset((*CONFIG_FILES, *TOKENIZER_FILES, INDEX_FILE))
MAX_SMALL_BYTES = MAX_INDEX_BYTES  # the largest small file (an index of a very large model)
MAX_OBJECTS = 10_000
CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class SourceObject:
    path: str  # relative to the prefix
    size: int
    etag: str

    @property
    def identity(self) -> str:
        """What the plan knows of the object without reading it: its name, size and ETag, hashed."""
        return sha256_json({"path": self.path, "size": self.size, "etag": self.etag})


class S3Source:
    """The objects directly under `s3://bucket/prefix/` (a model directory in a bucket)."""

    def __init__(self, url: str, *, client: Any = None, endpoint_url: str | None = None) -> None:
        from kiln.pipeline.store import _endpoint_from_env
        from kiln.storage.s3 import make_s3_client, parse_s3_url

        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(url)
        self.client = client if client is not None else make_s3_client(endpoint_url or _endpoint_from_env())
        self._listing: dict[str, SourceObject] | None = None

    def listing(self) -> dict[str, SourceObject]:
        """Every object directly under the prefix, by name (objects in sub-"directories" are not the model's)."""
        if self._listing is None:
            found: dict[str, SourceObject] = {}
            pages = self._call(self.client.get_paginator("list_objects_v2").paginate, Prefix=self.prefix)
            for page in self._each(pages):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(self.prefix) :]
                    if not name or "/" in name:
                        continue
                    try:
                        check_relative_path(name)
                    except ValueError as e:
                        raise SourceInvalid(f"source {self.url}: object {name!r}: {e}") from None
                    found[name] = SourceObject(name, int(obj["Size"]), str(obj["ETag"]).strip('"'))
                    if len(found) > MAX_OBJECTS:
                        raise SourceInvalid(f"source {self.url} holds more than {MAX_OBJECTS} objects")
            if not found:
                raise SourceInvalid(f"source {self.url} holds no objects", details={"source": self.url})
            self._listing = found
        return self._listing

    def mirror(self, dest: Path) -> Path:
        """The header mirror of the source at `dest` (see the module doc), made once per listing."""
        done = dest / ".complete"
        if done.is_file():
            return dest
        dest.mkdir(parents=True, exist_ok=True)
        for obj in self.listing().values():
            path = dest / obj.path
            if obj.path in SMALL_FILES:
                if obj.size > MAX_SMALL_BYTES:
                    raise SourceInvalid(f"{obj.path}: larger than the {MAX_SMALL_BYTES}-byte limit")
                path.write_bytes(self._range(obj, 0, obj.size))
                continue
            with open(path, "wb") as f:
                if obj.path.endswith(".safetensors") and obj.size >= 8:
                    head = self._range(obj, 0, 8)
                    n = int.from_bytes(head, "little")
                    f.write(head)
                    if 8 + n <= obj.size and n <= MAX_HEADER_BYTES:  # else the check of the mirror refuses it
                        f.write(self._range(obj, 8, 8 + n))
                f.truncate(obj.size)  # sparse: the size the header is checked against, no data
        done.write_text(self.url)
        return dest

    def download(self, name: str, dest: Path) -> str:
        """Stream object `name` into `dest` with ranged GETs; its sha256. It must be what the plan listed."""
        planned = self.listing()[name]
        h = hashlib.sha256()
        with open(dest, "wb") as out:
            for start in range(0, planned.size, CHUNK):
                chunk = self._range(planned, start, min(start + CHUNK, planned.size))
                h.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if dest.stat().st_size != planned.size:
            raise SourceInvalid(f"source {self.url}: {name} changed while it was read", details={"file": name})
        return h.hexdigest()

    def _range(self, obj: SourceObject, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of `obj`, refused if the object is no longer the one listed (If-Match)."""
        if stop <= start:
            return b""
        response = self._call(
            self.client.get_object,
            Key=self.prefix + obj.path,
            Range=f"bytes={start}-{stop - 1}",
            IfMatch=f'"{obj.etag}"',
        )
        body = response["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        if len(data) != stop - start:
            raise SourceInvalid(f"source {self.url}: {obj.path} is shorter than listed", details={"file": obj.path})
        return data

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        from kiln.storage.s3 import error_code, is_boto_error

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            if not is_boto_error(exc):
                raise
            code = error_code(exc) or type(exc).__name__
            if code in ("PreconditionFailed", "412"):
                raise SourceInvalid(
                    f"source {self.url}: {kwargs.get('Key')} changed since the build was planned; plan again",
                    code=Codes.SOURCE_CHANGED,
                ) from None
            if code in ("NoSuchKey", "404"):
                raise SourceInvalid(
                    f"source {self.url}: {kwargs.get('Key')} is gone", code=Codes.SOURCE_CHANGED
                ) from None
            raise Unavailable(f"source {self.url}: S3 failed: {code}", code=Codes.SOURCE_UNAVAILABLE) from None

    def _each(self, pages: Any) -> Any:
        from kiln.storage.s3 import error_code, is_boto_error

        try:
            yield from pages
        except Exception as exc:
            if not is_boto_error(exc):
                raise
            raise Unavailable(
                f"source {self.url}: S3 failed: {error_code(exc) or type(exc).__name__}", code=Codes.SOURCE_UNAVAILABLE
            ) from None
