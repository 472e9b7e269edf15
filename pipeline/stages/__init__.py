"""The stages kiln runs: ingest, reference, export, eval, publish."""
