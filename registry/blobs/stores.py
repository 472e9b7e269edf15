"""Opening the blob store a URL names, by scheme: `file:///abs/dir` or `s3://bucket/prefix`."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from kiln.core.errors import InvalidInput, UnknownName
from kiln.registry.settings import RegistrySettings
from kiln.storage.local import LocalBlobStore
from kiln.storage.store import BlobStore

SUPPORTED_SCHEMES = ("file", "s3")


def open_blob_store(url: str, settings: RegistrySettings | None = None) -> BlobStore:
    """The blob store for a URI, chosen by scheme: `file:///abs/dir` or `s3://bucket/prefix`.

    S3 takes its endpoint, part size and download mode from `settings` (KILN_REGISTRY_S3_*), and
    region and credentials from the standard AWS environment. The bucket is checked now, so a
    misconfigured store fails at startup (Unavailable) rather than on the first upload.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise InvalidInput(f"blob store URL {url!r}: file URLs need an absolute path (file:///dir)")
        return LocalBlobStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        # boto3 is an optional extra (`.[s3]`): imported only for an s3:// store.
        from kiln.storage.s3 import S3BlobStore, make_s3_client, parse_s3_url

        bucket, prefix = parse_s3_url(url)
        settings = settings or RegistrySettings()
        store = S3BlobStore(
            bucket,
            prefix,
            client=make_s3_client(settings.s3_endpoint_url),
            part_size=settings.s3_part_size,
            downloads=settings.s3_downloads,
            presign_expiry_s=settings.s3_presign_expiry_s,
        )
        store.check_bucket()
        return store
    raise UnknownName(
        f"unsupported blob store URL scheme {parsed.scheme!r} in {url!r}; supported: " + ", ".join(SUPPORTED_SCHEMES),
        details={"known": list(SUPPORTED_SCHEMES)},
    )
