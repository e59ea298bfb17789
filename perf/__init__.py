"""tfuture benchmarks: ``python -m perf`` runs them all, ``python -m perf.bench_resolve`` one.

Results (CSV, PNG, ``meta.json``, ``summary.json``, ``README.md``) go to the untracked
``perf/results/<device>-local/``; ``python -m perf --refresh`` (or ``PERF_REFRESH=1``) writes
the committed ``perf/results/<device>/``. See ``perf/README.md``.
"""

import os
import sys

# Headless plots: set before anything imports matplotlib.pyplot (triton's perf_report does lazily).
os.environ.setdefault("MPLBACKEND", "Agg")

# The interpreter runs about 0.45 ms per program: timing it says nothing about tfuture. Without
# it, tfuture takes its CPU reference path (numpy or torch on the host), which the CPU numbers measure.
# Not when the test suite imports perf: its kernels run under the interpreter (tests/conftest.py),
# and triton reads the variable again at its next launch.
if "pytest" not in sys.modules and os.environ.pop("TRITON_INTERPRET", "0") == "1":
    print("perf: ignoring TRITON_INTERPRET=1 (benchmarks time the real paths)", file=sys.stderr)
