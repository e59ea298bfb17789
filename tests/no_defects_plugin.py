"""A pytest plugin that removes every planted defect (``plant`` patches nothing), to show that
each defect test fails without its defect, i.e. that it could fail:

    PYTHONPATH=tests .venv/bin/python -m pytest -p no_defects_plugin tests/reliability/test_defects.py

Every test there must then FAIL. Not collected by ``make test`` (not a ``test_*`` file).
"""

import contextlib

import defects


@contextlib.contextmanager
def _no_defect(*names):
    yield


defects.plant = _no_defect
