"""Measured serving performance of an artifact on one SKU, which resolve prefers to its estimates."""
