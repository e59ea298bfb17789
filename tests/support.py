"""Helpers shared by the runtime and reliability tests (importable from any test folder)."""

import threading

WORKER_NAME = "tfuture-forward"


def worker_threads() -> list[threading.Thread]:
    """Forward-stream worker threads still alive: a finished or failed run leaves none."""
    return [t for t in threading.enumerate() if t.name == WORKER_NAME and t.is_alive()]
