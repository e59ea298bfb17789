"""Sync-vs-overlap equivalence: run one workload both ways and compare every request's tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tfuture.core.batch import Model
from tfuture.core.future_map import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.scheduler import ContinuousBatcher, RequestSpec
from tfuture.streams.backends import Delay
from tfuture.streams.stats import RunStats
from tfuture.testing.toy import ToyGrammar


@dataclass(slots=True)
class EquivalenceReport:
    """Outcome of :func:`check_equivalence`; ``message`` names the first difference, if any."""

    ok: bool
    message: str
    sync: dict[int, list[int]]
    overlap: dict[int, list[int]]
    sync_stats: RunStats
    overlap_stats: RunStats
    extra_tokens: int


def first_difference(a: dict[int, list[int]], b: dict[int, list[int]], names: tuple[str, str]) -> str | None:
    """A readable description of the first request whose tokens differ, or None."""
    for rid in sorted(set(a) | set(b)):
        if rid not in a or rid not in b:
            where = names[1] if rid not in b else names[0]
            return f"request {rid}: missing from the {where} run"
        x, y = a[rid], b[rid]
        if x != y:
            i = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
            tx = x[i] if i < len(x) else "<end>"
            ty = y[i] if i < len(y) else "<end>"
            return (
                f"request {rid}: token {i} differs: {names[0]} {tx}, {names[1]} {ty} "
                f"(lengths {len(x)} and {len(y)}; common prefix {x[:i][-5:]})"
            )
    return None


def run_workload(
    model: Model,
    specs: list[RequestSpec],
    *,
    overlap: bool,
    capacity: int = 64,
    device: torch.device | str = "cpu",
    delay: Delay | None = None,
    grammar: ToyGrammar | None = None,
    debug: bool = False,
    sampler: Sampler | None = None,
    trace: bool = False,
    **batcher_kw: Any,
) -> tuple[dict[int, list[int]], RunStats, ContinuousBatcher, FutureMap]:
    """Run ``specs`` through a :class:`ContinuousBatcher` on a fresh map; return the outputs.

    ``sampler``: tfuture's sampler instead of the model's ``sample`` (reset after each run, so
    one instance serves several runs). ``trace``: record the run's spans (device idle, trace)."""
    fmap = FutureMap(capacity, device=device, debug=debug)
    sched = ContinuousBatcher(specs, fmap, grammar=grammar, **batcher_kw)
    stats = OverlapRuntime(model, fmap, overlap=overlap, delay=delay, sampler=sampler, trace=trace).run(sched)
    return sched.outputs, stats, sched, fmap


def check_equivalence(
    make_model: Callable[[], Model],
    specs: list[RequestSpec],
    *,
    delay: Delay | None = None,
    **kw: object,
) -> EquivalenceReport:
    """Run ``specs`` in sync mode and in overlap mode (with ``delay`` injected on the forward
    stream) and compare every request's tokens exactly. Also checks that no slot is left in use.
    """
    sync, s_stats, _, s_map = run_workload(make_model(), specs, overlap=False, **kw)  # type: ignore[arg-type]
    over, o_stats, sched, o_map = run_workload(
        make_model(),
        specs,
        overlap=True,
        delay=delay,
        **kw,  # type: ignore[arg-type]
    )
    diff = first_difference(sync, over, ("sync", "overlap"))
    for name, fmap in (("sync", s_map), ("overlap", o_map)):
        if diff is None and fmap.in_use:
            diff = f"{name} run left {fmap.in_use} slot(s) in use at idle"
    return EquivalenceReport(
        diff is None, diff or "equivalent", sync, over, s_stats, o_stats, sched.extra_tokens
    )


def assert_equivalent(
    make_model: Callable[[], Model], specs: list[RequestSpec], **kw: object
) -> EquivalenceReport:
    """:func:`check_equivalence`, raising ``AssertionError`` with the first difference."""
    report = check_equivalence(make_model, specs, **kw)  # type: ignore[arg-type]
    if not report.ok:
        raise AssertionError(f"sync and overlap runs differ: {report.message}")
    return report
