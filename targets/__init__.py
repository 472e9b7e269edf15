"""Output formats. Each target module registers itself once by name (see `targets.base`)."""
