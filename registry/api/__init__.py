"""The HTTP layer shared by every domain: error mapping and path/query parameter types."""
