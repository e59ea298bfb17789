"""Soak test: a long randomized workload through the overlap runtime on the CPU backend.

``python tests/reliability/soak.py --steps N [--seed S] [--check-every K]`` (``make soak``: 100,000
steps; ``make test`` runs 5,000 in ``test_soak.py``)

The soak runs ``N`` overlapped steps in episodes. Each episode is a fresh seeded workload:
requests arrive over time, prompts are prefilled in chunks, some requests follow a grammar
(delayed sampling), requests finish on the end token or their length limit, and some are
aborted (see :class:`AbortingBatcher`); about one episode in five without grammars is a
speculative one (:class:`tfuture.spec.SpecTokenStep` over the toy target with
:class:`tfuture.testing.toy_drafter.ToyDrafter`, a seeded fallible draft, chunked prefill and
the episode's token budget), whose committed tokens must equal plain greedy decoding; about one
in four of the others runs with step graphs (``buckets=``, ``graphs=True``: its greedy steps as
the buckets' step graphs, emulated on CPU) and must still equal its sync rerun without them.
Episodes run on one long-lived :class:`FutureMap` (some on a fresh debug-mode map), each with
its own seeded :class:`FaultPlan`: stream and host delays, a ``gc.collect()`` after every step,
and now and then an exception at a planned point.

Checks (any failure exits nonzero):

* every ``K``-th episode is rerun in sync mode and must give the same tokens;
* an episode with a planned exception stops cleanly with :class:`InjectedFault`;
* no slot is in use after any episode, nor at the end;
* memory is flat: RSS growth from the end of warm-up (10% of the steps) to the end stays under
  ``--max-growth-mib``;
* no forward-stream thread outlives its run, and the thread count ends where it started.

The kernels must take their CPU path (``tfuture.kernels.cpu``), not the Triton interpreter (far
too slow for this many steps): run without ``TRITON_INTERPRET=1``. Run as a script, the soak re-executes
itself without it if it finds it set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from episodes import AbortingBatcher, Episode, compare, make_episode

from tfuture.core.future_map import FutureMap
from tfuture.kernels import _common
from tfuture.runtime import OverlapRuntime
from tfuture.sampling import Sampler
from tfuture.scheduler import ContinuousBatcher
from tfuture.spec import SpecTokenStep
from tfuture.testing.equivalence import first_difference
from tfuture.testing.faults import FaultPlan, InjectedFault
from tfuture.testing.toy import ToyModel
from tfuture.testing.toy_drafter import ToyDrafter

MIB = 1 << 20
SPEC_K = 2  # drafts per step in a speculative episode
THREAD_NAME = "tfuture-forward"


def rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes."""
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak


def stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@dataclass
class SoakReport:
    steps: int = 0
    episodes: int = 0
    requests: int = 0
    tokens: int = 0
    aborted: int = 0
    extra_tokens: int = 0
    debug_episodes: int = 0
    spec_episodes: int = 0
    sampled_episodes: int = 0  # per-request SamplingParams through tfuture's Sampler
    graph_episodes: int = 0  # step graphs (buckets, graphs=True; emulated on CPU)
    equivalence_checked: int = 0
    sync_steps: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    gc_steps: int = 0  # steps of episodes whose plan forces a gc.collect() after each step
    raised_episodes: int = 0
    slots_in_use_end: int = 0
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_max_after_warm_mib: float = 0.0
    rss_growth_mib: float = 0.0
    peak_rss_mib: float = 0.0
    leaked_threads: int = 0
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "faults"}
        d["faults"] = dict(sorted(self.faults.items()))
        d["faults_total"] = sum(self.faults.values())
        d["steps_per_s"] = round(self.steps_per_s, 1)
        d["ok"] = self.ok
        return d

    def summary(self) -> str:
        faults = ", ".join(f"{k}={v}" for k, v in sorted(self.faults.items())) or "none"
        lines = [
            f"steps:               {self.steps} overlapped ({self.sync_steps} more in sync reruns)",
            f"episodes:            {self.episodes} ({self.debug_episodes} on a debug map, "
            f"{self.spec_episodes} speculative, {self.sampled_episodes} with per-request sampling, "
            f"{self.graph_episodes} with step graphs, "
            f"{self.equivalence_checked} checked against sync, {self.raised_episodes} stopped by a fault)",
            f"requests:            {self.requests} ({self.aborted} aborted)",
            f"tokens:              {self.tokens} delivered, {self.extra_tokens} discarded (extra steps)",
            f"faults injected:     {sum(self.faults.values())} ({faults}; gc = forced collections)",
            f"slots in use at end: {self.slots_in_use_end}",
            f"peak RSS:            {self.peak_rss_mib:.1f} MiB",
            f"RSS growth:          {self.rss_growth_mib:+.1f} MiB after warm-up "
            f"({self.rss_warm_mib:.1f} -> {self.rss_end_mib:.1f} MiB, max {self.rss_max_after_warm_mib:.1f})",
            f"leaked threads:      {self.leaked_threads}",
            f"wall time:           {self.wall_s:.1f} s ({self.steps_per_s:.0f} steps/s)",
        ]
        lines += [f"FAILED: {f}" for f in self.failures]
        lines.append("soak: OK" if self.ok else f"soak: FAILED ({len(self.failures)} check(s))")
        return "\n".join(lines)


def run_sync(ep: Episode) -> tuple[dict[int, list[int]], int]:
    fmap = FutureMap(64, device="cpu")
    sched = AbortingBatcher(ep.specs, fmap, dict(ep.aborts), grammar=ep.grammar, **ep.batcher_kw)
    stats = OverlapRuntime(ep.model(), fmap, overlap=False, trace=False, sampler=ep.sampler()).run(sched)
    if fmap.in_use:
        raise AssertionError(f"sync rerun left {fmap.in_use} slot(s) in use")
    return sched.outputs, stats.steps


def spec_parts(ep: Episode, fmap: FutureMap, plan: FaultPlan) -> tuple[ContinuousBatcher, OverlapRuntime]:
    """The scheduler and runtime of a speculative episode: k = 2 drafts, 30% of them wrong, with
    the episode's chunk and token budget (at least a decode's 1 + k tokens)."""
    kw = ep.batcher_kw
    budget = max(kw["token_budget"], 1 + SPEC_K)
    sched = ContinuousBatcher(
        ep.specs,
        fmap,
        eos=0,
        max_running=kw["max_running"],
        chunk=kw["chunk"],
        token_budget=budget,
        speculative=SPEC_K,
    )
    drafter = ToyDrafter(ToyModel(vocab=ep.vocab), k=SPEC_K, error_rate=0.3, seed=ep.seed + ep.index)
    drafter.bind(kw["max_running"], 1 << 16, fmap.device)
    step = SpecTokenStep(ToyModel(vocab=ep.vocab), drafter, Sampler())
    return sched, OverlapRuntime(step, fmap, overlap=True, faults=plan, trace=False)


def reference_outputs(ep: Episode) -> dict[int, list[int]]:
    """Plain greedy decoding of the toy target, request by request on the host."""
    return ToyModel(vocab=ep.vocab).references(ep.specs, eos=0)


def run_checked(
    ep: Episode,
    runtime: OverlapRuntime,
    sched: Any,
    fmap: FutureMap,
    plan: FaultPlan,
    max_steps: int,
    report: SoakReport,
    where: str,
) -> tuple[BaseException | None, int]:
    """Run one episode overlapped and apply the checks every kind of episode shares: a planned
    fault raises and only a planned one, no slot in use, no thread left. Returns the injected
    fault (or None) and the steps the run reported (0 when it raised)."""
    raised: BaseException | None = None
    steps = 0
    try:
        steps = runtime.run(sched, max_steps=max_steps).steps
    except InjectedFault as exc:
        raised = exc
    except Exception:
        report.failures.append(f"{where}: unexpected exception\n{traceback.format_exc()}")
    report.faults.update(plan.injected)
    report.episodes += 1
    report.debug_episodes += ep.debug
    report.sampled_episodes += ep.sampled
    fired = sum(v for k, v in plan.injected.items() if k.startswith("raise_"))
    if raised is not None:
        report.raised_episodes += 1
        if not fired:
            report.failures.append(f"{where}: InjectedFault without a planned fault: {raised}")
    elif fired:
        report.failures.append(f"{where}: a planned fault fired but run() did not raise it")
    if fmap.in_use:
        report.failures.append(f"{where}: {fmap.in_use} slot(s) still in use after the episode")
    if stream_threads():
        report.failures.append(f"{where}: a forward-stream thread outlived its run")
    return raised, steps


def run_episode(ep: Episode, fmap: FutureMap, max_steps: int, check: bool, report: SoakReport) -> int:
    """Run one episode overlapped on ``fmap``; returns its steps. Failures go to ``report``."""
    where = f"episode {ep.index} (--seed {ep.seed} --only-episode {ep.index})"
    plan = FaultPlan(**ep.plan_kw)
    if ep.spec:
        return run_spec_episode(ep, fmap, max_steps, check, report, plan, where)
    sched = AbortingBatcher(ep.specs, fmap, dict(ep.aborts), grammar=ep.grammar, **ep.batcher_kw)
    runtime = OverlapRuntime(
        ep.model(), fmap, overlap=True, faults=plan, trace=False, sampler=ep.sampler(), **ep.runtime_kw()
    )
    report.graph_episodes += ep.graphs
    raised, _ = run_checked(ep, runtime, sched, fmap, plan, max_steps, report, where)
    steps = sched.batches
    if plan.gc_every_step:
        report.gc_steps += steps
    done = raised is None and sched.idle
    if done:
        report.requests += len(ep.specs)
        report.aborted += len(sched.aborted)
        report.tokens += sum(len(t) for t in sched.outputs.values())
        report.extra_tokens += sched.extra_tokens
    if done and check and not report.failures:
        sync, sync_steps = run_sync(ep)
        report.sync_steps += sync_steps
        report.equivalence_checked += 1
        diff = compare(ep, sync, sched.outputs)
        if diff is not None:
            report.failures.append(f"{where}: overlap differs from sync: {diff}")
    return steps


def run_spec_episode(
    ep: Episode, fmap: FutureMap, max_steps: int, check: bool, report: SoakReport, plan: FaultPlan, where: str
) -> int:
    """A speculative episode: overlapped greedy spec decoding must equal plain greedy decoding."""
    sched, runtime = spec_parts(ep, fmap, plan)
    raised, steps = run_checked(ep, runtime, sched, fmap, plan, max_steps, report, f"{where} (speculative)")
    report.spec_episodes += 1
    if raised is not None:
        # The run stopped at the fault: count its schedule calls toward the step budget.
        steps = max(steps, sched.tick)
    if plan.gc_every_step:
        report.gc_steps += steps
    finished = raised is None and len(sched.outputs) == len(ep.specs)
    if finished and check and not report.failures:
        report.equivalence_checked += 1
        # Greedy acceptance: the committed tokens equal plain greedy decoding of the target.
        diff = first_difference(
            reference_outputs(ep),
            sched.outputs,
            ("plain decoding", "overlapped speculative"),
        )
        if diff is not None:
            report.failures.append(f"{where}: speculative decoding differs: {diff}")
    if finished:
        report.requests += len(ep.specs)
        report.tokens += sum(len(t) for t in sched.outputs.values())
    return steps


def run_soak(
    steps: int,
    seed: int = 0,
    check_every: int = 4,
    capacity: int = 16,
    warmup: float = 0.1,
    max_growth_mib: float = 64.0,
    only_episode: int | None = None,
    progress: bool = True,
) -> SoakReport:
    """Run the soak for ``steps`` overlapped steps (or one episode); see the module docstring."""
    report = SoakReport()
    threads_before = threading.active_count()
    # Objects alive now (torch, triton, numpy) are never garbage: keep the collector off them,
    # so that the plan's gc.collect() after a step costs microseconds, not 0.1 s.
    gc.collect()
    gc.freeze()
    fmap = FutureMap(capacity, device="cpu")
    t0 = time.perf_counter()
    warm_at = max(1, int(steps * warmup))
    warm_rss: int | None = None
    max_after = 0
    next_progress = steps // 10
    index = 0 if only_episode is None else only_episode
    try:
        while report.steps < steps and not report.failures:
            ep = make_episode(seed, index)
            target = FutureMap(capacity, device="cpu", debug=True) if ep.debug else fmap
            check = only_episode is not None or (check_every > 0 and index % check_every == 0)
            report.steps += run_episode(ep, target, steps - report.steps, check, report)
            index += 1
            cur, _ = rss()
            if warm_rss is None and report.steps >= warm_at:
                warm_rss = cur
            elif warm_rss is not None:
                max_after = max(max_after, cur)
            if progress and report.steps >= next_progress > 0:
                rate = report.steps / (time.perf_counter() - t0)
                print(
                    f"[soak] {report.steps}/{steps} steps, {report.episodes} episodes, "
                    f"{rate:.0f} steps/s, RSS {cur / MIB:.1f} MiB",
                    flush=True,
                )
                next_progress += steps // 10
            if only_episode is not None:
                break
    finally:
        gc.unfreeze()
    report.wall_s = time.perf_counter() - t0
    report.slots_in_use_end = fmap.in_use
    end_rss, peak = rss()
    warm = warm_rss if warm_rss is not None else end_rss
    report.rss_warm_mib, report.rss_end_mib = warm / MIB, end_rss / MIB
    report.rss_max_after_warm_mib = max(max_after, end_rss) / MIB
    report.rss_growth_mib = (end_rss - warm) / MIB
    report.peak_rss_mib = peak / MIB
    report.leaked_threads = len(stream_threads()) + max(0, threading.active_count() - threads_before)
    if report.slots_in_use_end:
        report.failures.append(f"{report.slots_in_use_end} slot(s) in use at the end")
    if report.rss_growth_mib > max_growth_mib:
        report.failures.append(
            f"memory grew {report.rss_growth_mib:.1f} MiB after warm-up (bound {max_growth_mib} MiB)"
        )
    if report.leaked_threads:
        report.failures.append(f"{report.leaked_threads} thread(s) leaked")
    if only_episode is None and report.steps < steps and not report.failures:
        report.failures.append(f"ran {report.steps} of {steps} steps")
    if only_episode is None and check_every > 0 and report.episodes >= check_every:
        if not report.equivalence_checked and not report.failures:
            report.failures.append("no episode was checked against sync")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/reliability/soak.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--steps", type=int, default=5000, help="overlapped steps in total")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check-every", type=int, default=4, help="rerun every K-th episode in sync (0: never)"
    )
    parser.add_argument("--capacity", type=int, default=16, help="slots of the long-lived map")
    parser.add_argument("--max-growth-mib", type=float, default=64.0)
    parser.add_argument("--only-episode", type=int, default=None, help="replay one episode (with its check)")
    parser.add_argument("--json", default=None, help="also write the summary as JSON to this path")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if _common.INTERPRET:
        print("[soak] warning: TRITON_INTERPRET=1, the kernels run in the interpreter (slow)", flush=True)
    report = run_soak(
        args.steps,
        seed=args.seed,
        check_every=args.check_every,
        capacity=args.capacity,
        max_growth_mib=args.max_growth_mib,
        only_episode=args.only_episode,
        progress=not args.quiet,
    )
    print(report.summary(), flush=True)
    summary = report.as_dict()
    print("SOAK_SUMMARY " + json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    if _common.INTERPRET and os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter was chosen when tfuture was imported: start again without it.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    sys.exit(main())
