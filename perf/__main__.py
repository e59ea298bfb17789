"""``python -m perf``: every benchmark for the device at hand, then the contract and a README.

    python -m perf                      # into perf/results/<device>-local/ (untracked)
    python -m perf --refresh            # into the committed perf/results/<device>/
    python -m perf bench_host_cycle     # only the named benchmarks (the folder keeps the rest)
    CI=1 python -m perf                 # the small sweeps

``PERF_REFRESH=1`` does what ``--refresh`` does (``make perf-refresh`` sets it). A failing
benchmark is reported and the others still run (exit status 1 then). Contract misses do not
fail the run: they are results.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from typing import Any

from perf import contract, harness

BENCHES = [
    "bench_resolve",
    "bench_store",
    "bench_prepare",
    "bench_fields",
    "bench_bookkeeping",
    "bench_host_cycle",
    "bench_runtime_overhead",
    "bench_overlap",
    "bench_bitmask",
    "bench_sampling",
    "bench_grammar_overlap",
    "bench_distributed",
    "bench_hf",
    "bench_spec",
    "bench_direct",
    "bench_generate",
    "bench_multistep",
]
# What a full run rewrites: files a run of older benchmarks left behind go too.
OWNED = (".csv", ".png", ".html", "meta.json", "summary.json", "README.md")


def write_readme(folder: str, rows: list[dict[str, Any]]) -> str:
    meta, summary = harness.read_json("meta.json"), harness.read_json("summary.json")
    refresh = "python -m perf --refresh" if not folder.endswith("-local") else "python -m perf"
    md = [
        f"# tfuture perf results: {meta.get('device')}",
        "",
        f"{meta.get('device_name')}; torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"python {meta.get('python')}, {meta.get('torch_threads')} torch thread(s); commit "
        f"{meta.get('commit')}{' (tfuture/ or perf/ modified)' if meta.get('dirty') else ''}; "
        f"{meta.get('date')}; {'CI (small) sweeps' if meta.get('ci') else 'full sweeps'}. "
        f"Written by `{refresh}`. Timings are ratios within one run on a possibly shared machine.",
        "",
        "## Contract (DESIGN.md section 6), judged by `perf/contract.py`",
        "",
        "| target | limit | worst measured | status |",
        "|---|---|---|---|",
    ]
    for r in rows:
        measured = "-" if r["measured"] is None else r["measured"]
        md.append(f"| {r['what']} | {r['limit']} | {measured} | {r['status']} |")
    md += ["", "## Measured ratios and headline numbers", ""]
    for name, section in summary.items():
        if name not in ("plots", "contract", "run") and isinstance(section, dict):
            md += [f"- **{name}**: " + "; ".join(f"{k} = {v}" for k, v in section.items())]
    if skipped := [line for lines in meta.get("skipped", {}).values() for line in lines]:
        md += ["", "## Skipped here", "", *[f"- {line}" for line in skipped]]
    md += ["", "## Plots", ""]
    for plot, about in sorted(summary.get("plots", {}).items()):
        md += [
            f"### {plot}",
            "",
            about,
            "",
            f"![{plot}]({plot}.png)",
            "",
            f"Data: [{plot}.csv]({plot}.csv)",
            "",
        ]
    path = os.path.join(folder, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf", description=__doc__.split("\n\n")[0])
    parser.add_argument("benches", nargs="*", metavar="BENCH", help=f"default: all of {', '.join(BENCHES)}")
    parser.add_argument("--refresh", action="store_true", help="write the committed perf/results/<device>/")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.benches) - set(BENCHES)):
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    if args.refresh:
        os.environ["PERF_REFRESH"] = "1"
    folder = harness.results_dir()
    if not args.benches:
        for name in os.listdir(folder):
            if name.endswith(OWNED):
                os.remove(os.path.join(folder, name))
    failed, seconds = [], {}
    t_all = time.perf_counter()
    for name in args.benches or BENCHES:
        print(f"\n=== perf.{name} ({'CI' if harness.CI else 'full'} sweep) ===", flush=True)
        t0 = time.perf_counter()
        meta = harness.read_json("meta.json")
        harness.write_json("meta.json", meta | {"skipped": meta.get("skipped", {}) | {f"perf.{name}": []}})
        try:
            importlib.import_module(f"perf.{name}").main()
        except Exception:
            traceback.print_exc()
            failed.append(name)
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"=== perf.{name}: {seconds[name]} s{' FAILED' if name in failed else ''} ===", flush=True)
    seconds["total"] = round(time.perf_counter() - t_all, 1)
    harness.record("run", {"seconds": seconds, "failed": failed})
    harness.write_meta()
    readme = write_readme(folder, contract.main(folder))
    print(f"\nwrote {readme}; {seconds['total']} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
