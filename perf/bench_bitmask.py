"""Grammar masks per step: a bool mask vs the packed int32 bitmask, transfer + apply.

    python -m perf bench_bitmask          # CI=1: the small sweep

For each vocabulary (32k to 256k: Llama 2, 64k, Llama 3, Qwen 2, Gemma) and batch size, one
decode step's mask goes host to device and masks float32 logits ``[batch, vocab]`` in place
(about 10% of the tokens allowed, at random). Lines:

* ``bool``: a ``bool [batch, vocab]`` mask of banned tokens copied to the device (from pinned
  memory on CUDA; on CPU a copy), then ``logits.masked_fill_(mask, -inf)``. The bool mask's best
  case: the host builds the banned polarity, so no ``~mask`` launch.
* ``packed``: the ``int32 [batch, ceil(vocab / 32)]`` bitmask copied the same way, then
  ``apply_token_bitmask_`` (our Triton kernel on CUDA, the numpy path on CPU), checks included.
* ``xgrammar``: the same copy, then ``xgrammar.apply_token_bitmask_inplace`` (its Triton kernel on
  CUDA, its C++ kernel on CPU); skipped where xgrammar is not installed.
* ``bool_transfer``, ``packed_transfer``: the copy alone.

``bitmask_bs<batch>_gbps``: achieved bandwidth of the step lines (the mask copied and read, the
logits read and written) against the GPU's peak; the copy crosses the host link, so the peak is
a bound, not a target. On CPU, that of the host path.

``summary.json`` gets the bytes each mask moves per step and, per (vocab, batch), the step time
of bool over packed and of xgrammar over packed. On CPU ("device" = host) the whole step is
host time, and the sweep times a large step only a few times (it costs tens of milliseconds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton

from perf import harness
from perf.harness import DEVICE, HAS_CUDA
from tfuture.kernels.bitmask import apply_token_bitmask_, bitmask_words, pack_bool_mask

try:
    import xgrammar
except ImportError:  # pragma: no cover - depends on the environment
    xgrammar = None  # type: ignore[assignment]

VOCABS = harness.sweep([32000, 64000, 128256, 152064, 256000], [32000, 152064])
BATCH = harness.sweep([1, 16, 64, 256], [1, 64])
P_ALLOW = 0.1
STEPS = ["bool", "packed"] + (["xgrammar"] if xgrammar is not None else [])
LINES = [*STEPS, "bool_transfer", "packed_transfer"]
COLORS = {"bool": "red", "packed": "blue", "xgrammar": "green"}
STYLES = [(COLORS[line.split("_")[0]], ":" if line.endswith("transfer") else "-") for line in LINES]
# Seconds spent timing one expensive CPU point (a cheap one runs harness.host_us as usual).
CPU_BUDGET_S = 0.05 if harness.CI else 0.25
# (timer, vocab, batch, line) -> median us, for the summary.
MEDIANS: dict[tuple[str, int, int, str], float] = {}


class Step:
    """One (vocab, batch) point: host masks, device buffers, logits, and the step of each line."""

    def __init__(self, vocab: int, bs: int) -> None:
        g = torch.Generator().manual_seed(vocab + bs)
        allowed = torch.rand(bs, vocab, generator=g) < P_ALLOW
        pin = HAS_CUDA
        self.host_mask = torch.empty((bs, vocab), dtype=torch.bool, pin_memory=pin).copy_(~allowed)
        self.host_bits = torch.empty((bs, bitmask_words(vocab)), dtype=torch.int32, pin_memory=pin)
        self.host_bits.copy_(pack_bool_mask(allowed))
        self.dev_mask = torch.empty_like(self.host_mask, device=DEVICE)
        self.dev_bits = torch.empty_like(self.host_bits, device=DEVICE)
        self.logits = torch.randn(bs, vocab, generator=g).to(DEVICE)

    def bool_transfer(self) -> None:
        self.dev_mask.copy_(self.host_mask, non_blocking=True)

    def packed_transfer(self) -> None:
        self.dev_bits.copy_(self.host_bits, non_blocking=True)

    def bool(self) -> None:
        self.bool_transfer()
        self.logits.masked_fill_(self.dev_mask, float("-inf"))

    def packed(self) -> None:
        self.packed_transfer()
        apply_token_bitmask_(self.logits, self.dev_bits)

    def xgrammar(self) -> None:
        self.packed_transfer()
        xgrammar.apply_token_bitmask_inplace(self.logits, self.dev_bits)

    def check_same(self) -> None:
        """Every step line leaves the same logits (not timed)."""
        start = self.logits.clone()
        results = {}
        for line in STEPS:
            self.logits.copy_(start)
            getattr(self, line)()
            results[line] = self.logits.clone()
        for line in STEPS[1:]:
            if not torch.equal(results[line], results["bool"]):
                raise AssertionError(f"bitmask: {line} differs from bool at {tuple(start.shape)}")


@functools.lru_cache(maxsize=1)
def make_step(vocab: int, bs: int) -> Step:
    """The point's inputs, checked once; the lines of one point run back to back (one cached)."""
    step = Step(vocab, bs)
    step.check_same()
    return step


def cpu_us(fn: Callable[[], object]) -> harness.Timing:
    """Host time of one call: :func:`harness.host_us` when a call is cheap, else a few timed calls
    (median, p20, p80) within ``CPU_BUDGET_S``: a 256 x 256k step costs tens of milliseconds."""
    fn()
    once = harness.time_calls(fn, 1)
    if once < 1e-3:
        return harness.host_us(fn)
    repeats = int(min(31, max(3, CPU_BUDGET_S / once)))
    return harness.band([harness.time_calls(fn, 1) * 1e6 for _ in range(repeats)])


@triton.testing.perf_report(
    [
        triton.testing.Benchmark(
            x_names=["vocab"],
            x_vals=VOCABS,
            x_log=True,
            y_log=True,
            line_arg="provider",
            line_vals=LINES,
            line_names=LINES,
            styles=STYLES,
            xlabel=f"vocabulary (batch {bs}, float32 logits)",
            ylabel="us",
            plot_name=f"bitmask_bs{bs}_{timer}",
            args={"bs": bs, "timer": timer},
        )
        for bs in BATCH
        for timer in harness.TIMERS
    ]
)
def bitmask(vocab: int, provider: str, bs: int, timer: str) -> harness.Timing:
    """One step's grammar mask, host to device and applied: bool mask vs packed int32 bitmask.

    Device time (do_bench) or host wall time (CPU: the whole step), median, p20-p80.
    """
    fn = getattr(make_step(vocab, bs), provider)
    timing = cpu_us(fn) if not HAS_CUDA else harness.timed(fn, timer)
    MEDIANS[timer, vocab, bs, provider] = timing[0]
    return timing


def mask_bytes(line: str, vocab: int, bs: int) -> int:
    """Bytes of one step's mask: bool ``[bs, vocab]`` or packed int32 ``[bs, ceil(vocab / 32)]``."""
    return bs * vocab if line.startswith("bool") else 4 * bs * bitmask_words(vocab)


def look(bench: triton.testing.Benchmark) -> harness.Look:
    timer, bs = bench.args["timer"], bench.args["bs"]

    def moved(vocab: int, line: str) -> float | None:
        """A step line's bytes: the mask copied host to device and read, the logits read and
        written; the transfer lines cross the host link, not device memory: left out."""
        return None if line.endswith("transfer") else 2 * mask_bytes(line, vocab, bs) + 8 * bs * vocab

    full = timer == harness.FULL_TIMER
    return harness.Look(
        what=f"grammar mask copy + apply, batch {bs}: {harness.time_label(timer, 'step', unit=False)}",
        ylabel=harness.time_label(timer, "step"),
        xlabel=f"vocabulary (tokens; batch {bs}, float32 logits, {P_ALLOW:.0%} allowed)",
        bandwidth=harness.Bandwidth(
            f"bitmask_bs{bs}_gbps",
            f"grammar mask copy + apply, batch {bs}",
            moved,
            "mask copied and read + float32 logits read and written",
        )
        if full
        else None,
    )


def summarize() -> dict[str, Any]:
    """Bytes per step, and the step-time ratios per (vocab, batch), from the timer that sees the step."""
    timer = "device_time" if HAS_CUDA else "host_cost"
    out: dict[str, Any] = {
        "timer": timer,
        "p_allow": P_ALLOW,
        "mb_per_step_bool_packed": {
            f"v{v}_bs{bs}": [round(bs * v / 1e6, 3), round(4 * bs * bitmask_words(v) / 1e6, 3)]
            for v in VOCABS
            for bs in BATCH
        },
    }
    for line in STEPS[:1] + STEPS[2:]:
        out[f"{line}_over_packed"] = {
            f"v{v}_bs{bs}": round(MEDIANS[timer, v, bs, line] / MEDIANS[timer, v, bs, "packed"], 2)
            for v in VOCABS
            for bs in BATCH
        }
    out["packed_us"] = {
        f"v{v}_bs{bs}": round(MEDIANS[timer, v, bs, "packed"], 1) for v in VOCABS for bs in BATCH
    }
    return out


def main() -> None:
    if xgrammar is None:
        harness.skip("bitmask: xgrammar line", "xgrammar is not installed")
    if not HAS_CUDA:
        harness.skip(
            "bitmask device_time (all plots)",
            f"{harness.NO_GPU}; on CPU the host_cost plots time the whole step (transfer = a host copy)",
        )
    harness.save(bitmask, look)
    make_step.cache_clear()
    summary = summarize()
    harness.record("bitmask", summary)
    for key in ("bool_over_packed", "xgrammar_over_packed"):
        if key in summary:
            print(f"{key} ({summary['timer']} per step):", summary[key])


if __name__ == "__main__":
    main()
