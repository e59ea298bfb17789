"""Run the committed mutation set (``tests/mutants/mutants.py``) against its owning tests.

    .venv/bin/python tests/mutants/run.py            # every mutant, 2 processes (make mutants)
    .venv/bin/python tests/mutants/run.py --list     # the set, no run
    .venv/bin/python tests/mutants/run.py -k bitmask # mutants whose id contains "bitmask"

The working tree is never touched: the runner snapshots ``tfuture/``, ``tests/`` and
``pyproject.toml`` once (from the working tree, or from a git revision with ``--rev``) into a
temporary folder, then per mutant copies the snapshot, applies the mutant's one replacement to
the copy and runs ``python -m pytest -x -q -p no:cacheprovider <the mutant's tests>`` there, with
the copy as the working directory and first on ``PYTHONPATH``. A guard plugin checks, inside
the pytest run, that ``tfuture`` was imported from the mutated copy (not the working tree or
an installed one) and records the path it saw.

Each distinct test selection first runs once on the unmutated snapshot (the baseline): a
mutant is only counted as killed when its tests pass without it. Outcomes:

* ``killed``: the tests failed (or timed out) on the mutant and pass on the snapshot;
* ``survived``: the tests pass on the mutant;
* ``stale``: the mutant's original snippet no longer occurs exactly once in its file (someone
  edited the package: update the record), or a test path is gone;
* ``error``: the baseline failed, or pytest could not run (usage error, wrong import).

Exits 0 only when every mutant was killed. Not collected by pytest (not a ``test_*`` file).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from mutants import MUTANTS, Mutant  # noqa: E402

# What a mutant run needs from the repository (copied once, then per mutant).
SNAPSHOT = ("tfuture", "tests", "pyproject.toml")
MARKER, GUARD_MODULE = ".tfuture_imported_from", "_mutant_guard"
# Never copied: caches, and what a baseline run wrote into the snapshot it ran in.
IGNORE = shutil.ignore_patterns(
    "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", ".ruff_cache", MARKER, f"{GUARD_MODULE}.py"
)

GUARD_TEMPLATE = '''"""Written by tests/mutants/run.py: fail the run unless tfuture comes from this copy."""
import os

import pytest

ROOT = os.path.realpath(os.environ["TFUTURE_MUTANT_ROOT"])


def pytest_collection_finish(session):
    import tfuture  # conftest set TRITON_INTERPRET before any test module imported it

    path = os.path.realpath(tfuture.__file__)
    with open(os.path.join(ROOT, "MARKER"), "w") as f:
        f.write(path)
    if not path.startswith(ROOT + os.sep):
        pytest.exit(f"tfuture was imported from {path}, not from the mutated copy {ROOT}", returncode=4)
'''
GUARD = GUARD_TEMPLATE.replace("MARKER", MARKER)


@dataclasses.dataclass
class Outcome:
    """One pytest run: its return code, time, the first failure line, and where tfuture came from."""

    rc: int | None
    seconds: float
    detail: str = ""
    imported: str = ""
    timed_out: bool = False


@dataclasses.dataclass
class Report:
    mutant: Mutant
    status: str  # killed, survived, stale, error
    detail: str = ""
    seconds: float = 0.0


def snapshot(dst: Path, rev: str | None) -> None:
    """Copy what the runs need into ``dst``: the working tree's files, or ``rev``'s."""
    dst.mkdir(parents=True)
    if rev is None:
        for name in SNAPSHOT:
            src = REPO / name
            if src.is_dir():
                shutil.copytree(src, dst / name, ignore=IGNORE)
            else:
                shutil.copy2(src, dst / name)
        return
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev, *SNAPSHOT], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive.stdout, check=True)


def check_mutant(base: Path, m: Mutant) -> str | None:
    """Why ``m`` cannot be applied to the snapshot (None: it can)."""
    target = base / m.path
    if not target.is_file():
        return f"{m.path} does not exist"
    count = target.read_text().count(m.original)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times"
        return f"original snippet {where} in {m.path}"
    if m.replacement == m.original:
        return "replacement equals the original"
    for t in m.tests:
        if not (base / t.split("::")[0]).is_file():
            return f"test file {t.split('::')[0]} does not exist"
    return None


FAILED = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)


def run_pytest(root: Path, tests: Sequence[str], timeout: float) -> Outcome:
    """``python -m pytest -x -q`` on ``tests`` inside ``root`` (a snapshot copy)."""
    (root / f"{GUARD_MODULE}.py").write_text(GUARD)
    marker = root / MARKER
    marker.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(root),
        TFUTURE_MUTANT_ROOT=str(root),
        PYTHONDONTWRITEBYTECODE="1",
    )
    # Two runs share two cores: one torch thread each (unless the caller chose otherwise).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", GUARD_MODULE]
    cmd += ["-o", "console_output_style=classic", *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(None, time.perf_counter() - start, f"timed out after {timeout:.0f} s", timed_out=True)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    hit = FAILED.search(out)
    if hit:
        detail = f"{hit.group(1)} {hit.group(2)}"
    else:
        tail = [line for line in out.strip().splitlines() if line.strip()]
        detail = tail[-1] if tail else ""
    imported = marker.read_text() if marker.exists() else ""
    return Outcome(proc.returncode, seconds, detail, imported)


def run_copy(
    base: Path, root: Path, tests: Sequence[str], timeout: float, m: Mutant | None = None
) -> Outcome:
    """Copy the snapshot to ``root``, apply ``m`` (None: the baseline) there, run ``tests`` there."""
    shutil.copytree(base, root, ignore=IGNORE)
    if m is not None:
        target = root / m.path
        target.write_text(target.read_text().replace(m.original, m.replacement, 1))
    return run_pytest(root, tests, timeout)


def classify(m: Mutant, out: Outcome, base: Outcome | None) -> Report:
    if base is not None and base.rc != 0:
        return Report(m, "error", f"baseline failed without the mutant: {base.detail}", out.seconds)
    if out.timed_out:
        return Report(m, "killed", out.detail, out.seconds)
    want = str(Path(m.path).parts[0])
    if out.rc in (0, 1, 2) and out.imported and f"{os.sep}m-{m.id}{os.sep}{want}{os.sep}" not in out.imported:
        return Report(m, "error", f"tfuture imported from {out.imported}", out.seconds)
    if out.rc == 0:
        return Report(m, "survived", out.detail, out.seconds)
    if out.rc in (1, 2):  # tests failed, or collection failed (-x interrupts)
        return Report(m, "killed", out.detail, out.seconds)
    return Report(m, "error", f"pytest exit {out.rc}: {out.detail}", out.seconds)


def module_of(m: Mutant) -> str:
    return m.path.removesuffix(".py").replace("/", ".")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-j", "--jobs", type=int, default=2, help="parallel pytest processes (default 2)")
    ap.add_argument(
        "-k", dest="select", action="append", default=[], help="only mutants whose id contains this"
    )
    ap.add_argument("--rev", help="snapshot this git revision instead of the working tree (e.g. HEAD)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (timeout = killed)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (printed)")
    ap.add_argument("--list", action="store_true", help="list the set and exit")
    args = ap.parse_args(argv)

    ids = [m.id for m in MUTANTS]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        print(f"duplicate mutant ids: {dups}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.select or any(s in m.id for s in args.select)]
    if args.list:
        for m in chosen:
            print(f"{m.id:40} {m.path:34} {m.description}")
        print(f"{len(chosen)} mutants")
        return 0
    if not chosen:
        print("no mutant selected", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="tfuture-mutants-"))
    try:
        base = work / "base"
        snapshot(base, args.rev)
        reports: list[Report] = []
        runnable: list[Mutant] = []
        for m in chosen:
            why = check_mutant(base, m)
            if why is None:
                runnable.append(m)
            else:
                reports.append(Report(m, "stale", why))
        selections = sorted({tuple(m.tests) for m in runnable})
        print(
            f"{len(chosen)} mutants ({len(chosen) - len(runnable)} stale), {len(selections)} test "
            f"selections, {args.jobs} jobs, snapshot of {args.rev or 'the working tree'} in {work}",
            flush=True,
        )
        # Every run gets its own copy (baselines too): runs never share a directory.
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            base_futs = {}
            if not args.no_baseline:
                for i, sel in enumerate(selections):
                    base_futs[sel] = pool.submit(run_copy, base, work / f"b-{i}", sel, args.timeout)
            mut_futs = [
                (m, pool.submit(run_copy, base, work / f"m-{m.id}", m.tests, args.timeout, m))
                for m in runnable
            ]
            reported: set[tuple[str, ...]] = set()
            for m, fut in mut_futs:
                sel = tuple(m.tests)
                baseline = base_futs[sel].result() if sel in base_futs else None
                if baseline is not None and baseline.rc != 0 and sel not in reported:
                    reported.add(sel)
                    print(f"BASELINE FAILED ({baseline.rc}) {' '.join(sel)}: {baseline.detail}", flush=True)
                rep = classify(m, fut.result(), baseline)
                reports.append(rep)
                print(f"{rep.status.upper():9} {m.id:40} {rep.seconds:5.1f}s  {rep.detail}", flush=True)
        for rep in reports:
            if rep.status == "stale":
                print(f"STALE     {rep.mutant.id:40}         {rep.detail}")

        # Per module: killed / all.
        table: dict[str, list[Report]] = defaultdict(list)
        for rep in reports:
            table[module_of(rep.mutant)].append(rep)
        print(f"\n{'module':36} {'mutants':>7} {'killed':>6} {'rate':>6}  other")
        for mod in sorted(table):
            reps = table[mod]
            killed = sum(r.status == "killed" for r in reps)
            other = ", ".join(f"{r.mutant.id}: {r.status}" for r in reps if r.status != "killed")
            print(f"{mod:36} {len(reps):7} {killed:6} {killed / len(reps):6.0%}  {other}")
        killed = sum(r.status == "killed" for r in reports)
        elapsed = time.perf_counter() - t0
        print(f"{'total':36} {len(reports):7} {killed:6} {killed / len(reports):6.0%}")
        print(f"\n{killed}/{len(reports)} killed in {elapsed:.0f} s")
        return 0 if killed == len(reports) else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
