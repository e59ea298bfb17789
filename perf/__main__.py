"""``python -m perf``: run every benchmark, then write ``perf/results/<device>/README.md``.

Set ``CI=1`` for the small sweeps. Each module defines ``main()``; a failing module is reported
and the others still run (exit status 1 then).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

from perf._common import CI, REPO, device_name, device_slug, merge_summary, results_dir

BENCHES = ["bench_bookkeeping", "bench_resolve", "bench_prepare", "bench_store"]
# Hook list: each runs after BENCHES, in this order, only if perf/<name>.py exists.
OPTIONAL_BENCHES = ["bench_overlap", "bench_fields"]


def _modules() -> list[str]:
    here = os.path.join(REPO, "perf")
    return BENCHES + [m for m in OPTIONAL_BENCHES if os.path.exists(os.path.join(here, f"{m}.py"))]


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return "n/a" if v is None else str(v)


def _bookkeeping_table(section: dict[str, Any]) -> list[str]:
    per = section.get("us_per_call", {})
    if not per:
        return []
    cols = sorted(per, key=lambda c: int(c.removeprefix("bs")))
    ops = list(next(iter(per.values())))
    lines = ["| op (us per call) | " + " | ".join(c.replace("bs", "bs ") for c in cols) + " |"]
    lines.append("|---" * (len(cols) + 1) + "|")
    lines += [f"| {op} | " + " | ".join(_fmt(per[c].get(op)) for c in cols) + " |" for op in ops]
    return [*lines, ""]


def write_readme(since: float = 0.0) -> str:
    """Write README.md; PNGs older than ``since`` (not from this run) are listed apart."""
    out = results_dir()
    meta = _load(os.path.join(out, "meta.json"))
    summary = _load(os.path.join(out, "summary.json"))
    plots = summary.get("plots", {})
    md = [
        f"# tfuture perf results: {device_slug()}",
        "",
        f"Device: {device_name()}. torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"python {meta.get('python')}, commit {meta.get('commit')}"
        f"{' (dirty tree)' if meta.get('dirty') else ''}, {meta.get('date')}, "
        f"{'CI (small sweeps)' if meta.get('ci') else 'full sweeps'}. Written by `python -m perf`.",
        "",
        "## Headline numbers",
        "",
    ]
    for name, section in summary.items():
        if name in ("plots", "run") or not isinstance(section, dict):
            continue
        md += [f"### {name}", ""]
        if name == "bookkeeping":
            md += _bookkeeping_table(section)
        verdicts = section.get("verdicts", [])
        shown = ("verdicts", "us_per_call") if name == "bookkeeping" else ("verdicts",)
        md += [f"- {k}: {_fmt(v)}" for k, v in section.items() if k not in shown]
        md += [f"- **{v}**" for v in verdicts] + [""]
    skipped = [s for items in meta.get("skipped", {}).values() for s in items]
    if skipped:
        md += ["## Skipped", "", *[f"- {s}" for s in skipped], ""]
    md += ["## Plots", ""]
    pngs = sorted(f for f in os.listdir(out) if f.endswith(".png"))
    stale = [f for f in pngs if os.path.getmtime(os.path.join(out, f)) < since]
    for png in (f for f in pngs if f not in stale):
        stem = png.removesuffix(".png")
        md += [f"### {stem}", ""]
        if stem in plots:
            md += [plots[stem], ""]
        md += [f"![{stem}]({png})", f"Data: [{stem}.csv]({stem}.csv)", ""]
    if stale:
        md += ["## Older plots in this folder (not from this run)", ""]
        md += [f"- [{f}]({f})" for f in stale] + [""]
    path = os.path.join(out, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path


def main() -> int:
    out = results_dir()
    for stale in ("meta.json", "summary.json", "README.md"):
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    failed, seconds = [], {}
    t_all, started = time.perf_counter(), time.time() - 1.0
    for name in _modules():
        print(f"\n=== perf.{name} ({'CI sweep' if CI else 'full sweep'}) ===", flush=True)
        t0 = time.perf_counter()
        try:
            importlib.import_module(f"perf.{name}").main()
        except Exception:
            traceback.print_exc()
            failed.append(name)
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"=== perf.{name}: {seconds[name]} s{' FAILED' if name in failed else ''} ===", flush=True)
    seconds["total"] = round(time.perf_counter() - t_all, 1)
    merge_summary("run", {"seconds": seconds, "failed": failed, "ci": CI})
    readme = write_readme(since=started)
    print(f"\nwrote {readme}; results in {out}; {seconds['total']} s")
    if failed:
        print(f"FAILED modules: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
