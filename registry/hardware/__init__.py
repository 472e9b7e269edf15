"""The registry's hardware catalog: kiln's built-in catalog, extended and overridden by admins."""
