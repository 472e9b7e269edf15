"""Models: a named model (e.g. `tiny-llama`) that releases belong to."""
