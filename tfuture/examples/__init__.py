"""Runnable examples: ``python -m tfuture.examples.<name>``."""
