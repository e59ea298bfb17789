"""Where a speculative step's host time goes, phase by phase: plain decoding against
``NGramDrafter(k=4)`` on ``bench_spec``'s model and prompts, sync, untraced.

    python -m perf.profile_spec_phases [batch] [workload]    # default 8 repetitive

Each named phase (the scheduler's, the step's plan, prepare, verify, draft and store, the
runtime's launch and finish, the model's forward) is wrapped in a wall-clock timer for the
timed runs only; phases nest (``_launch`` holds the forward and the stream ops, ``schedule``
holds ``_build``). Prints ms per model step of each phase, after two warm-up runs, over
``RUNS`` runs. Finer than ``perf.profile_spec_ops`` (whose spans are the stream ops), and
without its tracing; the wrappers cost about a microsecond per call.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from perf import bench_spec

RUNS = 10

# (module, attribute path): the phases timed. A function imported by name elsewhere is wrapped
# where it is called from too.
PHASES = [
    ("tfuture.scheduler.serving", "ServingScheduler.schedule"),
    ("tfuture.scheduler.batcher", "ContinuousBatcher._build"),
    ("tfuture.scheduler.drafting", "DraftScheduling._draft_batch"),
    ("tfuture.steps.launch", "StepLauncher._launch"),
    ("tfuture.models.hf", "HFCausalLM.forward"),
    ("tfuture.steps.token", "TokenStep.plan_batch"),
    ("tfuture.spec.staging", "stage_drafts"),
    ("tfuture.spec.step", "SpecTokenStep.prepare"),
    ("tfuture.steps.token", "TokenStep.prepare"),
    ("tfuture.core.future_map", "FutureMap.launch_prepare"),
    ("tfuture.spec.step_rows", "true_positions_numpy"),
    ("tfuture.spec.ngram", "NGramDrafter.observe"),
    ("tfuture.spec.step", "SpecTokenStep._verify"),
    ("tfuture.spec.verify", "verify_greedy_host"),
    ("tfuture.spec.step", "SpecTokenStep._draft"),
    ("tfuture.spec.ngram", "NGramDrafter.draft"),
    ("tfuture.spec.step", "SpecTokenStep._store"),
    ("tfuture.runtime", "OverlapRuntime._finish"),
    ("tfuture.spec.step_result", "SpecResults.draft_result"),
    ("tfuture.scheduler.serving", "ServingScheduler.process"),
]


@contextlib.contextmanager
def timed_phases(totals: dict[str, float], calls: dict[str, int]) -> Iterator[None]:
    """Wrap every phase of :data:`PHASES` in a timer adding to ``totals`` and ``calls``; undone
    on exit."""

    undo: list[Callable[[], None]] = []
    try:
        for modname, path in PHASES:
            owner, name, real = phase(modname, path)
            fn = real.__func__ if isinstance(real, staticmethod) else real
            wrapped = _timer(path, fn, totals, calls)
            new = staticmethod(wrapped) if isinstance(real, staticmethod) else wrapped
            targets = [owner]
            if not isinstance(owner, type):  # a function imported by name into tfuture's modules
                targets += [
                    m
                    for key, m in list(sys.modules.items())
                    if key.startswith("tfuture.") and m is not owner and getattr(m, name, None) is fn
                ]
            for t in targets:
                setattr(t, name, new)
                undo.append(_restorer(t, name, real if t is owner else fn))
        yield
    finally:
        for u in reversed(undo):
            u()


def phase(modname: str, path: str) -> tuple[Any, str, Any]:
    """``(owner, name, value)`` of a phase: the module or class holding it, its attribute name,
    and what that attribute holds there (a class's ``staticmethod`` object itself)."""
    import importlib

    *owners, name = path.split(".")
    owner: Any = importlib.import_module(modname)
    for o in owners:
        owner = getattr(owner, o)
    return owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def _restorer(target: Any, name: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(target, name, value)


def _timer(
    path: str, fn: Callable[..., Any], totals: dict[str, float], calls: dict[str, int]
) -> Callable[..., Any]:
    clock = time.perf_counter

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[path] += clock() - t0
            calls[path] += 1

    return wrapped


def main(argv: list[str] | None = None) -> None:
    import torch

    import tfuture
    from tfuture.scheduler import GenerationParams

    args = sys.argv[1:] if argv is None else argv
    batch = int(args[0]) if args else 8
    workload = args[1] if len(args) > 1 else "repetitive"
    torch.set_num_threads(1)
    model = bench_spec.build()
    prompts = bench_spec.prompts(model, workload, batch)
    params = GenerationParams(max_tokens=bench_spec.NEW, temperature=0, ignore_eos=True)
    for name in ("plain", "ngram"):

        def run(name: str = name) -> Any:
            spec = tfuture.NGramDrafter(k=bench_spec.K) if name == "ngram" else None
            with tfuture.Engine(
                model, max_running=batch, max_len=len(prompts[0]) + bench_spec.NEW, overlap=False,
                speculative=spec,
            ) as engine:  # fmt: skip
                return engine.generate(prompts, params, progress=False)

        run(), run()  # warm-up
        totals: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        with timed_phases(totals, calls):
            t0 = time.perf_counter()
            for _ in range(RUNS):
                out = run()
            wall = time.perf_counter() - t0
        assert out.stats is not None
        steps = out.stats.steps
        per_step = wall / RUNS / steps * 1e3
        print(f"{name}: {steps} steps, {wall / RUNS * 1e3:.1f} ms a run, {per_step:.3f} ms a step "
              f"(batch {batch}, {workload}, sync)")  # fmt: skip
        for path in sorted(totals, key=lambda p: -totals[p]):
            ms = totals[path] / RUNS / steps * 1e3
            print(f"  {path:<36} {ms:7.3f} ms a step  ({calls[path] / RUNS:.0f} calls a run)")


if __name__ == "__main__":
    main()
