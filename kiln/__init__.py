"""kiln: build verified, hardware-specific LLM artifacts and serve them from a registry."""

__version__ = "0.1.0"
