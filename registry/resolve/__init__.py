"""Resolve: which artifact a node of some hardware should load from a model's channel, and why."""
