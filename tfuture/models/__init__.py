"""Adapters that drive real models through the runtime: the ``hf`` extra
(from a clone of tfuture: ``pip install -e '.[hf]'``).

Importing this package without ``transformers`` installed raises an ``ImportError`` (a
``ModuleNotFoundError``) that names the extra. Installed, ``transformers`` is still imported
lazily, on first use, not here.
"""

import importlib.util
import sys


def _installed(name: str) -> bool:
    """Whether top-level module ``name`` can be imported, without importing it."""
    if name in sys.modules:
        return sys.modules[name] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


if not _installed("transformers"):
    raise ModuleNotFoundError(
        "tfuture.models needs the 'hf' extra (transformers is not installed): from a clone of tfuture, "
        "pip install -e '.[hf]'",
        name="transformers",
    )

from tfuture.models.hf import HFCausalLM  # noqa: E402
from tfuture.models.kv_pool import KVPool, StepLayout  # noqa: E402

__all__ = ["HFCausalLM", "KVPool", "StepLayout"]
