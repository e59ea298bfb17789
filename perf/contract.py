"""Judge written results against the performance contract (DESIGN.md section 6).

    python -m perf.contract [RESULTS_DIR]   # default: this machine's results folder

Reads the CSVs and ``summary.json`` the benchmarks wrote, prints one row per target (what is
asked, the limit, the worst measured value, pass or MISS) and stores the rows in
``summary.json`` under ``contract``. Benchmarks and plots never judge; this module never
measures. Device-time targets need GPU results. The host cost per kernel call is judged on
GPU results only: on CPU the tfuture call runs its whole host path where torch runs its CPU
kernel, so that row is information.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from typing import Any

import numpy as np

# (what is asked, op, limit, where the values are): "<plot>: <line> / <line>" is a ratio of two
# lines of <plot>.csv; "a.b.c" is a path into summary.json. Every value must meet the limit.
TARGETS: list[tuple[str, str, float, str]] = [
    ("resolve device: tfuture / empty launch", "<=", 1.15, "resolve_device_time: tfuture / empty_launch"),
    ("resolve device: eager torch / tfuture", ">=", 3.5, "resolve_device_time: torch / tfuture"),
    ("resolve device: torch.compile / tfuture", ">", 1.0, "resolve_device_time: torch_compile / tfuture"),
    ("prepare device: unfused / fused", ">=", 4.0, "prepare_device_time: torch decode / tfuture decode"),
    ("prepare device: unfused / fused, mixed", ">=", 4, "prepare_device_time: torch mixed / tfuture mixed"),
    ("resolve host per call: tfuture / torch", "<=", 1.0, "resolve_host_cost: tfuture / torch"),
    ("store host per call: tfuture / index_put", "<=", 1.0, "store_host_cost: tfuture_slots / torch_index"),
    ("prepare host per call: fused / unfused", "<=", 1.0, "prepare_host_cost: tfuture decode / torch decode"),
    ("fields host per call: tfuture / torch", "<=", 1.0, "fields_host_cost: tfuture gather / torch gather"),
    ("host cycle: tfuture / seed ring", "<=", 0.8, "host_cycle.tfuture_over_seed_ring"),
    ("host cycle: tfuture / pool-indexed buffer", "<=", 1.5, "host_cycle.tfuture_over_pool_indexed"),
]
# The runtime's host time per step: the host thread's CPU time (trace off), batch 16 and 64, against
# the checked floor (the hand-written loop on FutureMap that also builds the checked Batch and
# StepResult a runtime's steps come as) and a minimal plain-torch loop. Judged on the inline stream
# (the host path a GPU sees, measurable on CPU) and, on a GPU, on CUDA streams with the same limits.
for _backend in ("inline", "auto"):
    for _mode in ("sync", "overlap"):
        _line = f"runtime_{_mode}_{_backend}"
        for _base, _limit in (("floor", 1.2), ("minimal", 3.0)):
            _what = f"host CPU per step, batch 16 and 64: {_line} / {_base}_{_mode}"
            TARGETS.append((_what, "<=", _limit, f"runtime_overhead.thread_cpu_over_{_base}.{_line}"))
TARGETS.append(
    (
        "host CPU per step, tracing on / off, batch 16 and 64 (overlap; inline, auto on a GPU)",
        "<=",
        1.10,
        "runtime_overhead.trace_cost",
    )
)
for _t, _limit in ((1, 1.5), (4, 1.15), (10, 1.08)):
    for _bs in (16, 64):
        _path = f"overlap.step_over_nominal.overlap_batch{_bs}.{_t}"
        _what = f"overlap step / nominal max(T_cpu, T_dev), {_t} ms, batch {_bs}"
        TARGETS.append((_what, "<=", _limit, _path))
# With step graphs (CUDA only: the line is measured on a GPU).
for _t, _limit in ((1, 1.1), (4, 1.05)):
    for _bs in (16, 64):
        _path = f"overlap.step_over_nominal.graphs_batch{_bs}.{_t}"
        _what = f"overlap with step graphs / nominal, {_t} ms, batch {_bs}"
        TARGETS.append((_what, "<=", _limit, _path))
TARGETS.append(("overlap device idle %, T_dev 4 ms, T_cpu 2 ms", "<", 3.0, "overlap.idle_pct_t_dev4_t_cpu2"))
# Speculative decoding through the front door (bench_spec): CPU targets of the speculative issue.
for _b in (1, 8):
    _rep, _rand = f"spec.repetitive b{_b}", f"spec.random b{_b}"
    TARGETS += [
        (
            f"spec: ngram k=4 steps per token, repetitive, batch {_b}",
            "<=",
            0.5,
            f"{_rep} ngram overlap.steps_per_token",
        ),
        (
            f"spec: ngram k=4 / plain tokens/s, repetitive, batch {_b}",
            ">=",
            1.6,
            f"{_rep} ngram overlap.over_plain",
        ),
        (
            f"spec: exact-twin draft model steps per token, batch {_b}",
            "<=",
            0.25,
            f"{_rep} twin overlap.steps_per_token",
        ),
    ]
    for _mode in ("overlap", "sync"):
        TARGETS.append(
            (
                f"spec: ngram / plain tokens/s, random, batch {_b}, {_mode}",
                ">=",
                0.95,
                f"{_rand} ngram {_mode}.over_plain",
            )
        )
    for _w in ("repetitive", "random"):
        for _d in ("plain", "ngram", "twin"):
            _what = f"spec: overlap / sync tokens/s, {_w}, batch {_b}, {_d}"
            TARGETS.append((_what, ">=", 1.0, f"spec.{_w} b{_b} {_d}.overlap_over_sync"))

# Multi-step decode (bench_multistep): CPU targets of the multi-step issue, K = 4 against K = 1.
TARGETS += [
    ("multistep: host CPU per token, K=4 / K=1 (host-bound)", "<=", 0.35, "multistep.K4.host_cpu_over_k1"),
    ("multistep: wall time per token, K=4 / K=1 (T_cpu = 2 T_dev)", "<=", 0.6, "multistep.K4.wall_over_k1"),
    (
        "multistep: tokens wasted per ended request, K=4, sync (<= K-1)",
        "<=",
        3,
        "multistep.K4.wasted_per_ended_request_sync",
    ),
    (
        "multistep: generate tokens/s, K=4 / K=1, 3M Llama, batch 8",
        ">=",
        1.5,
        "multistep.K4.generate_over_k1",
    ),
]

# End to end through the front door (bench_generate): tfuture.generate against Hugging Face
# generate, every cell (model, torch threads, batch) judged on its own.
for _size in ("3M", "80M"):
    for _t in (1, 2):
        for _b in (1, 8, 32):
            _cell = f"{_size}_t{_t}_b{_b}"
            _about = f"{_size} Llama, {_t} thread(s), batch {_b}"
            TARGETS += [
                (
                    f"generate: overlap / HF generate tokens/s, {_about}",
                    ">=",
                    1.0,
                    f"generate.overlap_over_hf.{_cell}",
                ),
                (
                    f"generate: overlap / sync tokens/s, {_about}",
                    ">=",
                    0.98,
                    f"generate.overlap_over_sync.{_cell}",
                ),
            ]


def column(folder: str, plot: str, line: str) -> np.ndarray | None:
    """Line ``line`` of ``<plot>.csv`` (perf_report names the column ``line (ylabel)``)."""
    try:
        with open(os.path.join(folder, f"{plot}.csv")) as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return None
    keys = [k for k in (rows[0] if rows else {}) if k == line or k.startswith(f"{line} (")]
    return np.array([float(r[keys[0]] or "nan") for r in rows]) if keys else None


def values(folder: str, summary: dict[str, Any], where: str) -> list[float]:
    """The measured values ``where`` names (empty if they were not written)."""
    if ": " in where:
        plot, lines = where.split(": ", 1)
        num, den = (column(folder, plot, line) for line in lines.split(" / "))
        return [] if num is None or den is None else [float(v) for v in num / den]
    node: Any = summary
    for key in where.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    node = list(node.values()) if isinstance(node, dict) else node
    node = [node] if isinstance(node, int | float) else node or []
    return [float("nan") if v is None else float(v) for v in node]


def judge(folder: str, summary: dict[str, Any], on_gpu: bool, target: tuple[str, str, float, str]) -> dict:
    what, op, limit, where = target
    got = values(folder, summary, where)
    finite = [v for v in got if np.isfinite(v)]
    row: dict[str, Any] = {"what": what, "limit": f"{op} {limit:g}", "measured": None, "source": where}
    if not finite:
        needs_gpu = not on_gpu and ("_device_time" in where or where.endswith("_auto") or "graphs_" in where)
        return row | {"status": "needs GPU" if needs_gpu else "no data"}
    worst = max(finite) if op in ("<=", "<") else min(finite)
    ok = {"<=": worst <= limit, "<": worst < limit, ">=": worst >= limit, ">": worst > limit}[op]
    status = "pass" if ok else "MISS"
    if not on_gpu and "_host_cost" in where:
        status = f"info ({status.lower()} on CPU paths)"
    return row | {"measured": round(worst, 3), "points": [round(v, 3) for v in got], "status": status}


def main(folder: str | None = None) -> list[dict[str, Any]]:
    """Judge the results in ``folder``, print the table, store it in ``summary.json``."""
    if folder is None:
        from perf.harness import results_dir

        folder = results_dir()
    path = os.path.join(folder, "summary.json")
    summary: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for name, data in ((path, summary), (os.path.join(folder, "meta.json"), meta)):
        if os.path.exists(name):
            with open(name) as f:
                data.update(json.load(f))
    on_gpu = meta.get("device", "cpu") != "cpu"
    rows = [judge(folder, summary, on_gpu, t) for t in TARGETS]
    width = max(len(r["what"]) for r in rows)
    print(f"\ncontract (DESIGN.md section 6), results in {folder}:")
    print(f"{'target':{width}}  {'limit':>7}  {'worst':>8}  status")
    for r in rows:
        measured = "-" if r["measured"] is None else f"{r['measured']:g}"
        print(f"{r['what']:{width}}  {r['limit']:>7}  {measured:>8}  {r['status']}")
    with open(path, "w") as f:
        f.write(json.dumps(summary | {"contract": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
