"""Releases: one immutable version of a model (source digest, lineage, architecture config)."""
