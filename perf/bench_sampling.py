"""Sampling cost per step with per-request parameters vs greedy (``tfuture.sampling.Sampler``).

    python -m perf.bench_sampling         # CI=1: the small sweep

``bs`` sampling rows of float32 logits ``[bs, vocab]``, one decode step each. Lines:

* ``argmax``: ``logits.argmax(1)``, the floor (what a greedy engine does).
* ``sampler_greedy``: the Sampler's step (``prepare``, ``observe``, ``sample``, ``record``) for
  a batch without parameters: one argmax, nothing else launched.
* ``per_request``: a mix of per-request parameters (temperature 0.6-1.2, top-p 0.9 or off,
  top-k 40 or off, min-p on a quarter of the rows, every fourth row greedy): penalties off.
* ``penalties``: the same mix with frequency, presence and repetition penalties on every row,
  a device history (``history_rows = bs``) read in ``sample`` and updated in ``observe`` and
  ``record`` (steady state: no row is assigned that step).

Plots: ``sampling_step_time_<vocab>``: device time per step on a GPU (``do_bench``), wall time
per step on CPU (one torch thread: the host does the math); ``sampling_plan_host``: host time
of ``Sampler.plan`` per step (numpy; on the scheduler's critical path), vocab independent.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numpy as np
import torch
import triton

from perf import harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture.sampling import Sampler, SamplerPlan, SamplingParams, pack_params

# A 1-thread CPU sorts 64 x 128k floats in ~1.4 s: the CPU sweep stays small (under a minute).
BATCH = harness.sweep([1, 16, 64, 256], [1, 16]) if HAS_CUDA else harness.sweep([1, 4, 16], [1, 4])
VOCABS = harness.sweep([32768, 131072], [32768])
LINES = ["argmax", "sampler_greedy", "per_request", "penalties"]
STYLES = [("black", ":"), ("blue", "--"), ("green", "-"), ("red", "-")]
PLAN_LINES = ["sampler_greedy", "per_request", "penalties"]
EMPTY = np.empty(0, dtype=np.int64)


def mix(bs: int, penalties: bool) -> list[SamplingParams]:
    """The per-request parameter mix of the ``per_request`` / ``penalties`` lines."""
    freq, pres, rep = (0.3, 0.2, 1.1) if penalties else (0.0, 0.0, 1.0)
    out = []
    for i in range(bs):
        greedy = i % 4 == 3
        out.append(
            SamplingParams(
                temperature=0.0 if greedy else 0.6 + 0.6 * (i % 5) / 4,
                top_p=0.9 if i % 2 else 1.0,
                top_k=40 if i % 3 == 0 else 0,
                min_p=0.05 if i % 4 == 1 else 0.0,
                seed=i,
                frequency_penalty=freq,
                presence_penalty=pres,
                repetition_penalty=rep,
            )
        )
    return out


class Case:
    """One (bs, vocab, provider): a Sampler with its history warm, a steady-state plan, inputs."""

    def __init__(self, bs: int, vocab: int, provider: str) -> None:
        self.bs, self.vocab, self.provider = bs, vocab, provider
        g = torch.Generator().manual_seed(bs * 7 + vocab)
        self.logits = (torch.randn(bs, vocab, generator=g) * 3).to(DEVICE)
        self.input_ids = torch.randint(0, vocab, (bs,), generator=g).to(DEVICE)
        penalties = provider == "penalties"
        self.sampler = Sampler(history_rows=bs if penalties else 0)
        self.table = None if provider in ("argmax", "sampler_greedy") else pack_params(mix(bs, penalties))
        self.step = 0
        first = self.plan_now()  # assigns the history rows (zeroed once)
        self._run(first, torch.from_numpy(first.words.copy()).to(DEVICE))
        self.plan = self.plan_now()  # steady state: no new rows
        self.words = torch.from_numpy(self.plan.words.copy()).to(DEVICE)

    def plan_now(self) -> SamplerPlan:
        """One host plan of a decode step at position 100 + step."""
        ones = np.ones(self.bs, dtype=np.int64)
        rids = np.arange(self.bs, dtype=np.int64)
        self.step += 1
        return self.sampler.plan(self.table, rids, ones, ones * (99 + self.step), rids, EMPTY, self.step)

    def run_step(self) -> torch.Tensor:
        """What runs on the forward stream for one (steady-state) step."""
        if self.provider == "argmax":
            return self.logits.argmax(dim=1)
        return self._run(self.plan, self.words)

    def _run(self, plan: SamplerPlan, words: torch.Tensor) -> torch.Tensor:
        state = self.sampler.prepare(plan, words)
        self.sampler.observe(state, self.input_ids)
        tokens = self.sampler.sample(state, self.logits)
        self.sampler.record(state, tokens)
        return tokens


@functools.cache
def case(bs: int, vocab: int, provider: str) -> Case:
    return Case(bs, vocab, provider)


def cpu_wall_us(fn: Callable[[], object]) -> harness.Timing:
    """Wall time of one call on CPU, us: median, p20, p80 of up to 7 calls (about 1 s at most)."""
    fn()
    samples: list[float] = []
    deadline = time.perf_counter() + 1.0
    while len(samples) < 7 and (len(samples) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return harness.band(samples)


def step_time(fn: Callable[[], object]) -> harness.Timing:
    return harness.device_us(fn) if HAS_CUDA else cpu_wall_us(fn)


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["bs"],
            x_vals=BATCH,
            x_log=True,
            y_log=True,
            line_arg="provider",
            line_vals=LINES,
            line_names=LINES,
            styles=STYLES,
            xlabel=f"sampling rows (float32 logits, vocab {vocab})",
            ylabel="us per step",
            plot_name=f"sampling_step_time_{vocab // 1024}k",
            args={"vocab": vocab},
        )
        for vocab in VOCABS
    ]
)
def sampling_step(bs: int, provider: str, vocab: int) -> harness.Timing:
    """One step's sampling: device time (do_bench) on a GPU, wall time (1 torch thread) on CPU."""
    return step_time(case(bs, vocab, provider).run_step)


@triton.testing.perf_report(
    triton.testing.Benchmark(
        x_names=["bs"],
        x_vals=harness.sweep([1, 16, 64, 256], [1, 16]),
        x_log=True,
        y_log=True,
        line_arg="provider",
        line_vals=PLAN_LINES,
        line_names=PLAN_LINES,
        styles=STYLES[1:],
        xlabel="requests in the step (all sample)",
        ylabel="host us per step",
        plot_name="sampling_plan_host",
        args={},
    )
)
def sampling_plan(bs: int, provider: str) -> harness.Timing:
    """Host time of Sampler.plan for one decode step (numpy; no device work)."""
    c = Case(bs, 64, provider)  # the vocab does not matter on the host
    return harness.host_us(c.plan_now)


def look_step(bench: triton.testing.Benchmark) -> harness.Look:
    label = "device time per step" if HAS_CUDA else "wall time per step (1 torch thread)"
    return harness.Look(
        what=f"sampling, vocab {bench.args['vocab']}: {label}",
        ylabel=f"{label.split(' (')[0]} (µs)",
        xlabel=f"sampling rows (requests; float32 logits, vocab {bench.args['vocab']})",
    )


PLAN_LOOK = harness.Look(
    what="Sampler.plan: host time per step",
    ylabel=harness.time_label("host_cost", "step"),
    xlabel="requests in the step (all sample)",
)


def check_greedy(bs: int, vocab: int) -> None:
    """The Sampler's greedy step equals the argmax line (not timed)."""
    c = case(bs, vocab, "sampler_greedy")
    if not torch.equal(c.run_step(), c.logits.argmax(dim=1)):
        raise AssertionError(f"sampling: greedy Sampler differs from argmax at bs={bs}, vocab={vocab}")


def main() -> None:
    for vocab in VOCABS:
        for bs in BATCH:
            check_greedy(bs, vocab)
    if not HAS_CUDA:
        harness.skip("sampling device time", f"{harness.NO_GPU}; CPU wall time is plotted instead")
    harness.save(sampling_step, look_step)
    harness.save(sampling_plan, lambda _: PLAN_LOOK)
    summary: dict[str, float] = {}
    vocab, bs = VOCABS[0], BATCH[-1]
    base = step_time(case(bs, vocab, "argmax").run_step)[0]
    for provider in LINES[1:]:
        summary[f"{provider} / argmax, bs {bs}, vocab {vocab}"] = round(
            step_time(case(bs, vocab, provider).run_step)[0] / base, 2
        )
    for provider in PLAN_LINES:
        summary[f"plan host us, {provider}, bs 64"] = round(
            harness.host_us(Case(64, 64, provider).plan_now)[0], 1
        )
    harness.record("sampling", summary)
    print(summary)


if __name__ == "__main__":
    main()
