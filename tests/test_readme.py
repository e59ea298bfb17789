"""Every Python block of the README runs as written on this machine (CPU or GPU)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code: str):
    try:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    except ImportError as exc:
        # The GPU image has no xgrammar and no registry to install it from; `make test`
        # installs the grammar extra, so there a missing xgrammar still fails.
        if "xgrammar" in str(exc) and importlib.util.find_spec("xgrammar") is None:
            pytest.skip(f"needs the grammar extra (xgrammar): {exc}")
        raise
