"""Paged KV-cache storage and attention over it."""
