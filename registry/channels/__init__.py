"""Channels: named aliases (dev, staging, prod) to a release; promotion is checked here."""
