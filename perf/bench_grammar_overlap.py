"""What "only grammar rows wait" buys: step time against the share of grammar requests.

    python -m perf bench_grammar_overlap      # CI=1: fewer steps and repeats

``BATCH`` requests decode for ``STEPS`` steps; a share of them (0%, 50%, 100%) follows a toy
grammar whose matcher spends ``FILL_US`` of Python host time per mask row (holding the GIL).
``ToyModel(work_s=T_DEV)`` does ``T_DEV`` of device work per forward (plus its logits), the
scheduler ``T_CPU`` of host work per processed step (a sleep: work that releases the GIL, so
the CPU worker's sampling is not starved by a spinning host), and every request samples with
tfuture's :class:`Sampler` (temperature 1, top-p 0.95 over ``VOCAB`` tokens: a sort per row,
real work on the CPU worker). Lines: overlap and sync, each with ``delay="rows"`` (only the
grammar requests are delayed: the other rows sample right after the forward, while the host
processes the last step and builds the masks) and ``delay="batch"`` (the whole step's sample
waits for the mask as soon as one grammar request samples). The step time is the median launch
interval after ``WARMUP`` steps; each share's runs are interleaved (``REPEATS`` rounds, the
order rotating) and the median kept.

Expected: equal at 0% (nothing waits) and at 100% (every sampling row waits: both settings
launch the same steps, so their difference there is the run-to-run noise). At 50%, the host
waits after building the masks for the late sample before it can process the step: "rows"
shortens that wait from all rows' sampling to the grammar rows', until the device (forward,
then both sampling parts) becomes the longer side. On CPU, sampling in two parts costs more
device time than in one (two sampler calls, a gather and a scatter), so the gain is smaller
than the free rows' share of sampling.
"""

from __future__ import annotations

import functools

import numpy as np
import triton

from perf import harness
from perf.harness import DEVICE
from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler, SamplingParams
from tfuture.testing import ContinuousBatcher, RequestSpec, ToyGrammar, ToyModel
from tfuture.testing.toy import ToyMatcher
from tfuture.testing.workload import spin

SHARES = [0, 50, 100]  # percent of the batch's requests with a grammar
BATCH = 16
VOCAB = 2048
T_DEV_MS = 2.0
T_CPU_MS = 4.0
FILL_US = 50.0
STEPS, REPEATS = harness.sweep([40, 8], [20, 2])
WARMUP = 5
LINES = [(mode, delay) for mode in ("overlap", "sync") for delay in ("rows", "batch")]
NAMES = [f"{mode}, delay={delay}" for mode, delay in LINES]
STYLES = [("blue" if m == "overlap" else "red", "-" if d == "rows" else "--") for m, d in LINES]


class SlowMatcher(ToyMatcher):
    """A toy matcher whose ``fill_bitmask`` spins ``FILL_US`` first (Python, holds the GIL)."""

    __slots__ = ()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        spin(FILL_US / 1e6)
        super().fill_bitmask(bitmask, row)


class SlowGrammar(ToyGrammar):
    def matcher(self) -> SlowMatcher:
        return SlowMatcher(self)


GRAMMAR = SlowGrammar(VOCAB, seed=0, density=0.5)


def step_ms(share: int, overlap: bool, delay: str) -> float:
    """One run: the median launch interval in ms after ``WARMUP`` steps."""
    n_grammar = BATCH * share // 100
    prompt = np.array([1, 2, 3], dtype=np.int64)
    specs = [
        RequestSpec(i, 0, prompt, 10**6, i < n_grammar, SamplingParams(temperature=1.0, top_p=0.95, seed=i))
        for i in range(BATCH)
    ]
    fmap = FutureMap(4 * BATCH + 64, device=DEVICE)
    sched = ContinuousBatcher(
        specs,
        fmap,
        grammar=GRAMMAR,
        eos=-1,
        max_running=BATCH,
        token_budget=4 * BATCH,
        host_work_s=T_CPU_MS / 1e3,
        host_work_holds_gil=False,
        delay=delay,
    )
    runtime = OverlapRuntime(
        ToyModel(vocab=VOCAB, work_s=T_DEV_MS / 1e3), fmap, overlap=overlap, sampler=Sampler(), trace=True
    )
    stats = runtime.run(sched, max_steps=STEPS)
    starts = np.sort([s.start for s in stats.host_spans if s.name == "launch"])[WARMUP:]
    return float(np.median(np.diff(starts))) * 1e3


@functools.cache
def measured(share: int) -> dict[tuple[str, str], float]:
    """Median step ms of every line at ``share``: the lines' runs interleaved, in an order that
    rotates every repeat (the first run of a round is often slower on a shared machine)."""
    step_ms(share, True, "rows")  # warm-up, not counted
    got: dict[tuple[str, str], list[float]] = {line: [] for line in LINES}
    for rep in range(REPEATS):
        for mode, delay in LINES[rep % len(LINES) :] + LINES[: rep % len(LINES)]:
            got[(mode, delay)].append(step_ms(share, mode == "overlap", delay))
    return {line: float(np.median(v)) for line, v in got.items()}


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["share"],
        x_vals=SHARES,
        x_log=False,
        y_log=False,
        line_arg="line",
        line_vals=LINES,
        line_names=NAMES,
        styles=STYLES,
        xlabel=f"grammar requests, % of {BATCH} ({DEVICE}; T_dev {T_DEV_MS:g}, T_cpu {T_CPU_MS:g} ms)",
        ylabel="step time, ms",
        plot_name="grammar_overlap_step_ms",
        args={},
    )
)
def grammar_step(share: int, line: tuple[str, str]) -> float:
    """Step time (ms) against the share of grammar requests: only grammar rows wait
    (delay="rows") or the whole step waits (delay="batch"), overlapped and in sync."""
    return measured(share)[line]


# The floor of a step: the device side (forward; sampling comes on top) or the host side (its
# work plus the grammar rows' mask fill), whichever is longer.
FLOOR = harness.Ref(
    "floor max(T_dev, T_cpu + mask fill)",
    [max(T_DEV_MS, T_CPU_MS + BATCH * share // 100 * FILL_US / 1e3) for share in SHARES],
)
LOOK = harness.Look(
    what="step time against the share of grammar requests (delay rows vs batch)",
    ylabel="ms per step",
    xlabel=f"grammar requests (% of {BATCH}; {DEVICE}, T_dev {T_DEV_MS:g} ms, T_cpu {T_CPU_MS:g} ms, "
    f"fill {FILL_US:g} µs per row)",
    refs=(FLOOR,),
)


def main() -> None:
    harness.save(grammar_step, lambda _: LOOK)
    per_line = {f"{m}_{d}": {str(s): round(measured(s)[(m, d)], 3) for s in SHARES} for m, d in LINES}
    gain = {
        mode: {str(s): round(measured(s)[(mode, "batch")] / measured(s)[(mode, "rows")], 3) for s in SHARES}
        for mode in ("overlap", "sync")
    }
    harness.record(
        "grammar_overlap",
        {
            "steps": STEPS,
            "batch": BATCH,
            "t_dev_ms": T_DEV_MS,
            "t_cpu_ms": T_CPU_MS,
            "fill_us_per_row": FILL_US,
            "step_ms": per_line,
            "batch_over_rows": gain,
        },
    )
    for name, values in per_line.items():
        print(f"{name}: step ms per grammar share (%): {values}")
    for mode, values in gain.items():
        print(f"{mode}: step time delay=batch / delay=rows per grammar share (%): {values}")


if __name__ == "__main__":
    main()
