"""The ground every layer stands on: errors with stable codes, digests and canonical JSON, the artifact
manifest, strict parsing of untrusted data. It imports nothing of kiln's above it."""

__version__ = "0.1.0"  # kiln's version, recorded in provenance (pyproject.toml's project.version)
