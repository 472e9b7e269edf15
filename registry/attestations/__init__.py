"""Attestations of an artifact: its signature (OpenSSF model signing) and build provenance (in-toto SLSA)."""
