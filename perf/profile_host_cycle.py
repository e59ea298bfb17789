"""Where tfuture's host cycle spends its time: the ``tfuture`` line of ``bench_host_cycle``
under cProfile, top functions by own time (what the contract's host-cycle misses come from).

    python -m perf.profile_host_cycle [bs]     # default bs 64
"""

from __future__ import annotations

import cProfile
import pstats
import sys

from perf.bench_host_cycle import Inputs, tfuture_cycle


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    cycle = tfuture_cycle(Inputs(int(args[0]) if args else 64))
    for _ in range(200):
        cycle()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        cycle()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
