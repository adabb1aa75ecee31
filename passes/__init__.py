"""Passes: one file per pass, one class per file, registered by name."""
