"""Audit: an append-only log of changes that need a record (promotions, forced ones with their reason)."""
