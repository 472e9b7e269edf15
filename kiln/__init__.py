"""kiln: build verified, hardware-specific LLM artifacts and serve them from a registry."""

from kiln.core import __version__  # noqa: F401 - the one version, kept in core
