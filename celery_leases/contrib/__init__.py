"""Integrations with frameworks; each depends on the core, never the other way."""
