"""The OCI distribution spec v1.1, pull side, at /v2/: artifacts as ModelPack OCI manifests over the stored blobs."""
