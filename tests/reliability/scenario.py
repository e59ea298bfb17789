"""The scenario the reliability tests share: 10 requests, at most 4 running, a 32-slot map.

:func:`run` runs it once, with an exception as part of the :class:`Outcome` (a planted defect
may raise), and :func:`verdict` says how a run went wrong, if it did.
"""

from __future__ import annotations

from dataclasses import dataclass

from defects import plant
from support import worker_threads

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.testing import (
    ContinuousBatcher,
    RequestSpec,
    ToyGrammar,
    ToyModel,
    first_difference,
    random_workload,
)
from tfuture.testing.faults import FaultPlan

VOCAB = 64
CAPACITY = 32
SPECS = random_workload(5, 10, vocab=VOCAB, max_new=10)
GRAMMAR_SPECS = random_workload(5, 10, vocab=VOCAB, max_new=10, grammar_share=1.0)
GRAMMAR = ToyGrammar(VOCAB, seed=5)


@dataclass
class Outcome:
    outputs: dict[int, list[int]] | None
    error: BaseException | None
    in_use: int


def run(
    specs: list[RequestSpec],
    *,
    overlap: bool = True,
    faults: FaultPlan | None = None,
    debug: bool = False,
    grammar: ToyGrammar | None = None,
    defect: str | None = None,
) -> Outcome:
    """One run of ``specs`` (with ``defect`` planted); an exception is part of the outcome."""
    fmap = FutureMap(CAPACITY, device="cpu", debug=debug)
    sched = ContinuousBatcher(specs, fmap, max_running=4, grammar=grammar)
    runtime = OverlapRuntime(ToyModel(vocab=VOCAB), fmap, overlap=overlap, faults=faults)
    try:
        with plant(*([defect] if defect else [])):
            runtime.run(sched)
    except Exception as exc:
        return Outcome(None, exc, fmap.in_use)
    return Outcome(sched.outputs, None, fmap.in_use)


def verdict(out: Outcome, ref: dict[int, list[int]]) -> str:
    """How a run went wrong: 'raised <type>: ...', 'differs: ...', or '' (it did not)."""
    if out.error is not None:
        return f"raised {type(out.error).__name__}: {out.error}"
    diff = first_difference(ref, out.outputs or {}, ("sync", "overlap"))
    return f"differs: {diff}" if diff else ""


def assert_clean(out: Outcome, ref: dict[int, list[int]]) -> None:
    """The run gave ``ref``'s tokens and left no slot in use and no worker thread alive."""
    assert out.error is None, f"the defect-free run raised {out.error!r}"
    assert out.outputs == ref, first_difference(ref, out.outputs or {}, ("sync", "overlap"))
    assert out.in_use == 0
    assert not worker_threads()
