"""Blobs in an S3 bucket (or any S3-speaking server): streamed multipart uploads, verified before they appear.

An upload is hashed while it streams to S3. A blob that fits in one part is sent with PutObject
only once its sha256 is known to match (and S3 checks that sha256 again on arrival); a larger
one goes up as a multipart upload that is completed, and so becomes visible under its key, only
when the digest matches; otherwise it is aborted. Nothing is ever visible under a blob's key
that was not verified, and an upload's memory is bounded by the part size, not the blob's.

Every botocore error is translated here: a missing object is `BlobNotFound`, an unreachable or
failing S3 is `Unavailable` (503), so nothing above this module knows about boto.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Literal
from urllib.parse import urlparse

from kiln.core.error_codes import Codes
from kiln.core.errors import DigestMismatch, InvalidInput, KilnError, Unavailable
from kiln.storage.store import DEFAULT_CHUNK, BlobNotFound, check_sha256

DownloadMode = Literal["stream", "redirect"]

MIN_PART_SIZE = 5 * 1024 * 1024  # S3's floor for every part but the last
MAX_PARTS = 10_000  # S3's ceiling on parts per upload
DEFAULT_PART_SIZE = 64 * 1024 * 1024
# Bucket names as S3 accepts them (3-63 of lowercase letters, digits, dots and hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
# One boto3 session for the process: it loads the S3 service model once (a new session takes
# ~0.3 s per client). Sessions are not thread-safe, so clients are created under a lock; the
# clients themselves are safe to share between threads.
_session: Any = None
_session_lock = threading.Lock()


def is_boto_error(exc: BaseException) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(exc, BotoCoreError | ClientError)


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix/"); the prefix is "" for a whole bucket."""
    parsed = urlparse(url)
    if parsed.scheme != "s3":
        raise InvalidInput(f"not an s3:// URL: {url!r}", code=Codes.INVALID_BLOB_URL)
    if parsed.query or parsed.fragment or parsed.params:
        raise InvalidInput(
            f"blob store URL {url!r}: an s3 URL is s3://bucket[/prefix], with no query or fragment "
            "(the endpoint comes from KILN_REGISTRY_S3_ENDPOINT_URL)",
            code=Codes.INVALID_BLOB_URL,
        )
    bucket = parsed.netloc
    if not _BUCKET.fullmatch(bucket):
        raise InvalidInput(
            f"blob store URL {url!r}: {bucket!r} is not a valid S3 bucket name "
            "(3-63 lowercase letters, digits, '.' or '-')",
            code=Codes.INVALID_BLOB_URL,
        )
    parts = [p for p in parsed.path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise InvalidInput(
            f"blob store URL {url!r}: the prefix may not contain '.' or '..'", code=Codes.INVALID_BLOB_URL
        )
    return bucket, "".join(p + "/" for p in parts)


def make_s3_client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client; region and credentials come from the standard AWS environment and files.

    A custom endpoint (MinIO, Ceph, a test server) gets path-style addressing, which every
    S3-speaking server understands; virtual-hosted style would need DNS for each bucket.
    """
    try:
        import boto3
        from botocore.config import Config
    except ImportError:  # pragma: no cover - only without the s3 extra
        raise Unavailable(
            "the s3:// blob store needs boto3: pip install 'kiln[s3]'", code=Codes.BLOB_STORE_UNAVAILABLE
        ) from None
    config = Config(
        signature_version="s3v4",
        retries={"mode": "standard", "max_attempts": 3},
        connect_timeout=5,
        read_timeout=60,
        # Downloads stream from the server's thread pool; each holds a connection while it runs.
        max_pool_connections=64,
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    global _session
    with _session_lock:
        if _session is None:
            _session = boto3.session.Session()
        return _session.client("s3", endpoint_url=endpoint_url, config=config)


class S3BlobStore:
    """Blobs as objects `<prefix>ab/cd/abcd...` in one bucket, uploaded in parts of `part_size` bytes."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any,
        part_size: int = DEFAULT_PART_SIZE,
        downloads: DownloadMode = "stream",
        presign_expiry_s: int = 3600,
        chunk_size: int = DEFAULT_CHUNK,
    ):
        if part_size < MIN_PART_SIZE:
            raise InvalidInput(
                f"S3 part size {part_size} is below S3's minimum of {MIN_PART_SIZE} bytes",
                code=Codes.INVALID_SETTING,
                details={"part_size": part_size, "minimum": MIN_PART_SIZE},
            )
        if downloads not in ("stream", "redirect"):
            raise InvalidInput(
                f"S3 downloads must be 'stream' or 'redirect', not {downloads!r}", code=Codes.INVALID_SETTING
            )
        self.bucket = bucket
        self.prefix = prefix
        self.client = client
        self.part_size = part_size
        self.downloads = downloads
        self.presign_expiry_s = presign_expiry_s
        self.chunk_size = chunk_size
        # What s3transfer does: with botocore's default integrity checks on, every part carries a
        # CRC32 that S3 verifies, and the completed upload lists them.
        self._part_checksums = client.meta.config.request_checksum_calculation == "when_supported"

    def __repr__(self) -> str:
        return f"S3BlobStore('s3://{self.bucket}/{self.prefix}')"

    def key(self, sha256: str) -> str:
        check_sha256(sha256)
        return f"{self.prefix}{sha256[:2]}/{sha256[2:4]}/{sha256}"

    # -- errors ----------------------------------------------------------------------------------

    def _translate(self, exc: BaseException, sha256: str | None = None) -> KilnError:
        """The domain error for a botocore error: missing object -> BlobNotFound, else Unavailable."""
        code = error_code(exc)
        if sha256 is not None and code in _NOT_FOUND_CODES:
            return BlobNotFound(f"blob {sha256} not found", details={"sha256": sha256})
        where = f"s3://{self.bucket}/{self.prefix}"
        if code == "NoSuchBucket":
            return Unavailable(
                f"blob store {where}: the bucket does not exist",
                code=Codes.BLOB_STORE_UNAVAILABLE,
                details={"s3": code},
            )
        details = {"s3": code} if code else {"error": type(exc).__name__}
        # The message names the failure, never credentials or signed URLs.
        return Unavailable(
            f"blob store {where} failed: {code or type(exc).__name__}",
            code=Codes.BLOB_STORE_UNAVAILABLE,
            details=details,
        )

    def check_bucket(self) -> None:
        """Raise Unavailable unless the bucket exists and these credentials can reach it."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            if is_boto_error(exc):
                code = error_code(exc)
                if code in ("404", "NoSuchBucket", "NotFound"):
                    raise Unavailable(
                        f"blob store s3://{self.bucket}/{self.prefix}: the bucket does not exist",
                        code=Codes.BLOB_STORE_UNAVAILABLE,
                    ) from None
                raise self._translate(exc) from None
            raise

    # -- the BlobStore protocol -----------------------------------------------------------------

    def _head(self, sha256: str) -> dict[str, Any]:
        try:
            response: dict[str, Any] = self.client.head_object(Bucket=self.bucket, Key=self.key(sha256))
        except Exception as exc:
            if is_boto_error(exc):
                raise self._translate(exc, sha256) from None
            raise
        return response

    def exists(self, sha256: str) -> bool:
        try:
            self._head(sha256)
        except BlobNotFound:
            return False
        return True

    def size(self, sha256: str) -> int:
        return int(self._head(sha256)["ContentLength"])

    def put_stream(self, sha256: str, chunks: Iterable[bytes]) -> int:
        key = self.key(sha256)
        digest = hashlib.sha256()
        size = 0
        pending = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        try:
            for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
                pending += chunk
                while len(pending) >= self.part_size:
                    if upload_id is None:
                        upload_id = self._create_upload(key)
                    parts.append(self._upload_part(key, upload_id, len(parts) + 1, bytes(pending[: self.part_size])))
                    del pending[: self.part_size]
            actual = digest.hexdigest()
            if actual != sha256:
                raise DigestMismatch(
                    f"content has sha256 {actual}, not the claimed {sha256}",
                    details={"expected": sha256, "actual": actual, "size": size},
                )
            if upload_id is None:
                # One part's worth or less: a single PutObject, which S3 checks against the sha256 too.
                self._call(
                    "put_object",
                    sha256,
                    Key=key,
                    Body=bytes(pending),
                    ChecksumSHA256=base64.b64encode(digest.digest()).decode(),
                    **self._object_headers(),
                )
            else:
                if pending:
                    parts.append(self._upload_part(key, upload_id, len(parts) + 1, bytes(pending)))
                # Only now does the object appear under its key, complete and verified.
                self._call(
                    "complete_multipart_upload",
                    sha256,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
                upload_id = None
            return size
        finally:
            if upload_id is not None:
                # A mismatch, a broken stream or a failed part: the parts are dropped, nothing appears.
                with contextlib.suppress(Exception):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    def _object_headers(self) -> dict[str, Any]:
        # Content-addressed bytes never change: caches (and presigned downloads) may keep them for good.
        return {"ContentType": "application/octet-stream", "CacheControl": "public, max-age=31536000, immutable"}

    def _create_upload(self, key: str) -> str:
        extra = {"ChecksumAlgorithm": "CRC32"} if self._part_checksums else {}
        response = self._call("create_multipart_upload", None, Key=key, **self._object_headers(), **extra)
        return str(response["UploadId"])

    def _upload_part(self, key: str, upload_id: str, number: int, body: bytes) -> dict[str, Any]:
        extra = {"ChecksumAlgorithm": "CRC32"} if self._part_checksums else {}
        if number > MAX_PARTS:
            raise InvalidInput(
                f"upload needs more than {MAX_PARTS} parts of {self.part_size} bytes; raise the S3 part size",
                code=Codes.PAYLOAD_TOO_LARGE,
                details={"part_size": self.part_size, "max_parts": MAX_PARTS},
            )
        response = self._call("upload_part", None, Key=key, UploadId=upload_id, PartNumber=number, Body=body, **extra)
        part = {"ETag": response["ETag"], "PartNumber": number}
        if self._part_checksums and "ChecksumCRC32" in response:
            part["ChecksumCRC32"] = response["ChecksumCRC32"]
        return part

    def _call(self, operation: str, sha256: str | None, **kwargs: Any) -> dict[str, Any]:
        try:
            response: dict[str, Any] = getattr(self.client, operation)(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            if is_boto_error(exc):
                raise self._translate(exc, sha256) from None
            raise
        return response

    def open_range(self, sha256: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        total = self.size(sha256)  # raises BlobNotFound now, not mid-iteration
        stop = total if end is None else min(end, total)
        if start < 0 or start > stop:
            raise InvalidInput(f"invalid range [{start}, {stop}) of a {total}-byte blob")
        return self._read(sha256, start, stop)

    def _read(self, sha256: str, start: int, stop: int) -> Iterator[bytes]:
        # Nothing is requested until the first iteration, so an unconsumed iterator holds no connection.
        if start == stop:
            return
        response = self._call("get_object", sha256, Key=self.key(sha256), Range=f"bytes={start}-{stop - 1}")
        body = response["Body"]
        try:
            while True:
                try:
                    chunk = body.read(self.chunk_size)
                except Exception as exc:
                    if is_boto_error(exc):
                        raise self._translate(exc, sha256) from None
                    raise
                if not chunk:
                    break
                yield chunk
        finally:
            body.close()

    def delete(self, sha256: str) -> None:
        # S3 answers a delete of a missing key with success: deleting twice is not an error.
        self._call("delete_object", None, Key=self.key(sha256))

    def download_url(self, sha256: str) -> str | None:
        """A presigned GET URL, valid `presign_expiry_s` seconds, in redirect mode; None when streaming."""
        if self.downloads != "redirect":
            return None
        try:
            url: str = self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self.key(sha256)},
                ExpiresIn=self.presign_expiry_s,
            )
        except Exception as exc:
            if is_boto_error(exc):
                raise self._translate(exc, sha256) from None
            raise
        return url

    def pending_uploads(self) -> list[str]:
        """Keys of multipart uploads started under this prefix and neither completed nor aborted."""
        try:
            response = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        except Exception as exc:
            if is_boto_error(exc):
                raise self._translate(exc) from None
            raise
        return [u["Key"] for u in response.get("Uploads", [])]
