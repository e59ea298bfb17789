"""A/A calibration: how far apart one benchmark line lands from itself on this machine.

    python -m perf.noise_aa generate 3M 2 8          # bench_generate's cell: 3M model, 2 threads, batch 8
    python -m perf.noise_aa spec repetitive 8 ngram  # bench_spec's cell: workload, batch, drafter

Runs a cell's lines as its sweep does (every line of the cell, warmed up, interleaved by
:func:`perf.harness.interleaved`, the sweep's repeats) with one more line at the end of the turn
order, ``sync again``: the ``sync`` line's own call a second time. ``--trials`` times. Per trial
it prints the ratio the contract reads (median over median, as the sweep's summary computes it)
of ``overlap / sync`` and of ``sync again / sync``, then the range of each over the trials. The
A/A ratio compares the same code with itself: its spread is the resolution of that contract line
on the machine at hand, below which an ``overlap / sync`` miss says nothing about the code. Not a
sweep of ``python -m perf``; ``--save`` records the trials in ``summary.json`` under ``noise_aa``
(with ``PERF_REFRESH=1``, the committed results folder's). Needs the ``hf`` extra.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from perf import harness

Runs = dict[str, Callable[[], float]]


def generate_runs(size: str, threads: int, batch: int) -> tuple[Runs, int]:
    """bench_generate's lines of one cell (``overlap``, ``sync``, ``hf``), then ``sync again``;
    its repeats."""
    from perf import bench_generate as bg

    model = bg.build_or_none(size, [])
    if model is None:
        raise SystemExit("noise_aa: transformers is missing (the hf extra)")
    torch.set_num_threads(threads)
    warm = bg.prompts(size, 2)
    (
        bg.hf_run(model, warm, 4),
        bg.hf_cb_run(model, warm, 4),
        bg.tfuture_run(model, warm, 4, True),
    )  # as measure()
    ps, tokens = bg.prompts(size, batch), {}
    runs = bg.runs(model, ps, bg.NEW[size], tokens)
    runs["sync again"] = runs["sync"]
    return runs, bg.REPEATS[size]


def spec_runs(workload: str, batch: int, drafter: str) -> tuple[Runs, int]:
    """bench_spec's six lines of one cell, then ``sync again`` of ``drafter``; its repeats."""
    import copy

    from perf import bench_spec as bs

    torch.set_num_threads(1)
    model = bs.build()
    twin = copy.deepcopy(model)
    ps = bs.prompts(model, workload, batch)

    def line(name: str) -> Callable[[], float]:
        return lambda: bs.one_run(model, twin, ps, name)[0]

    runs = {name: line(name) for name in bs.LINES}
    for warm in runs.values():
        warm()  # as measure() warms every line up
    runs = {name.replace(f"{drafter} ", ""): run for name, run in runs.items()}
    runs["sync again"] = runs["sync"]
    return runs, bs.REPEATS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=["generate", "spec"])
    parser.add_argument("cell", nargs=3, help="generate: size threads batch; spec: workload batch drafter")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument(
        "--save",
        action="store_true",
        help="record the trials in summary.json (PERF_REFRESH=1: the committed one)",
    )
    args = parser.parse_args()
    a, b, c = args.cell
    with torch.inference_mode():
        runs, repeats = (
            generate_runs(a, int(b), int(c)) if args.bench == "generate" else spec_runs(a, int(b), c)
        )
        ratios: dict[str, list[float]] = {"overlap / sync": [], "sync again / sync (A/A)": []}
        for t in range(args.trials):
            got = harness.interleaved(runs, repeats)
            sync = float(np.median(got["sync"]))
            ratios["overlap / sync"].append(float(np.median(got["overlap"])) / sync)
            ratios["sync again / sync (A/A)"].append(float(np.median(got["sync again"])) / sync)
            print(f"trial {t}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items()), flush=True)
    print(f"{args.bench} {' '.join(args.cell)}, {args.trials} trials of {repeats} interleaved repeats:")
    for k, v in ratios.items():
        print(f"  {k:<24} median {np.median(v):.3f}, range {min(v):.3f}-{max(v):.3f}")
    if args.save:
        entry = {
            "trials": {k: [round(x, 4) for x in v] for k, v in ratios.items()},
            "repeats": repeats,
            "commit": harness._git("rev-parse", "--short", "HEAD"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        harness.record("noise_aa", {f"{args.bench} {' '.join(args.cell)}": entry})
        print(f"recorded under noise_aa in {harness.results_dir()}/summary.json")


if __name__ == "__main__":
    main()
