"""Blobs: content-addressed bytes (by sha256), stored in a `BlobStore` and recorded in the database."""
