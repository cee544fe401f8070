"""Runnable examples (not installed with the package)."""
