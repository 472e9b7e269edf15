"""Access control: API tokens (stored hashed) with scopes, optionally limited to model name patterns."""
