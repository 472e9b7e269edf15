"""Alembic migrations for the registry schema. Run them with `registry.migrate.upgrade` (no alembic.ini)."""
