"""Artifacts: a target's output for one release (files, hardware, runtime) and its eval results."""
