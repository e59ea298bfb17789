"""perf/harness.save draws what the plots promise: perf_report's CSV untouched, a title with the
device, units on the axes, the reference lines, the legend off the axes, a tick on every x value,
and the achieved-bandwidth plot against the device's peak (or the plain reason there is none).
Nothing here times anything: the benchmark function returns made-up numbers."""

import csv
import json
import os
import sys

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("pandas")
import matplotlib

matplotlib.use("agg")
import matplotlib.pyplot as plt
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perf import harness

SIZES = [16, 512, 32768]


def _mark() -> triton.testing.Mark:
    @triton.testing.perf_report(
        [
            triton.testing.Benchmark(
                x_names=["n"],
                x_vals=SIZES,
                x_log=True,
                y_log=True,
                line_arg="provider",
                line_vals=["fast", "slow", "absent"],
                line_names=["fast", "slow", "absent"],
                styles=[("blue", "-"), ("red", "--"), ("green", ":")],
                xlabel="tokens",
                ylabel="us",
                plot_name=f"fake_{timer}",
                args={"timer": timer},
            )
            for timer in ("device_time", "host_cost")
        ]
    )
    def fake(n: int, provider: str, timer: str) -> harness.Timing:
        """A made-up call: 1 us plus 1 ns a token, twice that for "slow"."""
        if provider == "absent":
            return harness.NAN3
        us = (1.0 + n / 1e3) * (2 if provider == "slow" else 1)
        return us, 0.9 * us, 1.1 * us

    return fake


def _look(bench: triton.testing.Benchmark) -> harness.Look:
    timer = bench.args["timer"]
    bandwidth = harness.Bandwidth("fake_gbps", "fake", lambda n, p: None if p == "slow" else 8.0 * n, "8 B")
    return harness.Look(
        what=f"fake: {harness.time_label(timer, unit=False)}",
        ylabel=harness.time_label(timer),
        refs=(harness.Ref("floor", 1.0), harness.Ref("ideal", lambda m: m["fast"] / 2)),
        bandwidth=bandwidth if timer == "device_time" else None,
    )


@pytest.fixture
def folder(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(harness, "results_dir", lambda: str(tmp_path))
    monkeypatch.setattr(harness, "write_meta", lambda *a: None)
    return str(tmp_path)


def _saved_figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Every figure save() writes, by file name, kept open for the test to read."""
    figures: dict[str, object] = {}
    savefig = matplotlib.figure.Figure.savefig

    def keep(fig: object, path: str, **kwargs: object) -> None:
        figures[os.path.basename(path)] = fig
        savefig(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "Some New GPU", None])
def test_save_draws_the_promised_plots(folder: str, monkeypatch: pytest.MonkeyPatch, gpu: str | None) -> None:
    monkeypatch.setattr(harness, "HAS_CUDA", gpu is not None)
    monkeypatch.setattr(harness, "device_name", lambda: gpu or "cpu (test)")
    figures = _saved_figures(monkeypatch)
    harness.save(_mark(), _look)
    assert not plt.get_fignums()

    # perf_report's CSV, as the contract reads it: the ylabel in the column names.
    with open(os.path.join(folder, "fake_device_time.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["n", "fast (us)", "slow (us)", "absent (us)"]
    assert [float(r[0]) for r in rows[1:]] == SIZES

    ax = figures["fake_device_time.png"].axes[0]
    assert ax.get_title().splitlines()[0] == "fake: device time per call"
    assert ax.get_title().splitlines()[1].startswith(gpu or "cpu (test)")
    assert ax.get_ylabel() == "device time per call (µs)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "512", "32768"]
    legend = ax.get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["fast", "slow", "floor", "ideal", "not run here: absent"]
    assert legend.get_bbox_to_anchor().x0 > ax.get_window_extent().x1  # right of the axes

    bw = figures["fake_gbps.png"].axes[0]
    bw_labels = [t.get_text() for t in bw.get_legend().get_texts()]
    assert bw_labels[0] == "fast" and "slow" not in bw_labels
    if gpu == "NVIDIA H200":
        assert bw_labels[1] == "peak DRAM bandwidth, 4.8 TB/s (NVIDIA H200)"
        assert 4800.0 in [line.get_ydata()[0] for line in bw.get_lines()]
    elif gpu:
        assert bw_labels[1].startswith("unknown device 'Some New GPU': no peak line")
    else:
        assert "host-bound" in bw_labels[1] and "host-bound" in bw.get_title()
    with open(os.path.join(folder, "fake_gbps.csv")) as f:
        gbps = list(csv.DictReader(f))
    assert float(gbps[-1]["fast (GB/s)"]) == pytest.approx(8 * 32768 / (1 + 32.768) / 1e3)

    with open(os.path.join(folder, "summary.json")) as f:
        plots = json.load(f)["plots"]
    assert set(plots) == {"fake_device_time", "fake_host_cost", "fake_gbps"}
    assert plots["fake_device_time"].startswith("A made-up call")


def test_contract_targets_on_a_plot_become_bounds() -> None:
    bench = triton.testing.Benchmark(
        x_names=["n"],
        x_vals=SIZES,
        line_arg="provider",
        line_vals=["tfuture", "torch", "torch_compile", "empty_launch"],
        line_names=["tfuture", "torch", "torch_compile", "empty_launch"],
        styles=[("blue", "-"), ("red", "--"), ("green", "-."), ("black", ":")],
        plot_name="resolve_device_time",
        args={},
    )
    refs = {r.label: r for r in harness.contract_refs(bench)}
    near_launch, under_torch = (
        f"contract: tfuture ≤ 1.15{harness.TIMES}empty_launch",
        "contract: tfuture ≤ torch / 3.5",
    )
    # torch.compile / tfuture > 1 is the torch_compile line itself: no extra line.
    assert set(refs) == {near_launch, under_torch}
    medians = {"empty_launch": 2.0, "torch": 7.0}
    assert refs[near_launch].y(medians) == pytest.approx(2.3)
    assert refs[under_torch].y(medians) == pytest.approx(2.0)


def test_the_hf_plot_sweeps_several_batch_sizes() -> None:
    # Issue 30 item 14: hf_tokens_per_s.png had one x point (batch 4 only), an empty plot.
    from perf import bench_hf

    bench = bench_hf.hf_tokens.benchmarks
    assert bench.x_names == ["batch"] and len(bench.x_vals) >= 2
    assert bench_hf.MAX_BATCH == max(bench.x_vals)  # the KV pool holds the largest batch


def test_the_overlap_ratio_plot_draws_the_sync_2x_bound() -> None:
    # Issue 30 item 14: sync runs T_cpu then T_dev, 2x the nominal max at T_cpu = T_dev.
    from perf import bench_overlap

    ratio = next(
        b for b in bench_overlap.overlap_step.benchmarks if b.plot_name == "overlap_step_over_nominal"
    )
    bounds = [r for r in bench_overlap.look(ratio).refs if r.y == 2.0]
    assert len(bounds) == 1 and "sync" in bounds[0].label and "2" in bounds[0].label


def test_bench_generate_plots_every_model_and_thread_count_with_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One tokens/s plot per (model, torch threads), lines overlap, sync, hf and hf_cb; tfuture's
    tokens are checked against HF greedy (the padded batch, else each request unpadded)."""
    from perf import bench_generate as bg

    benches = bg.generate_report.benchmarks
    assert [(b.args["size"], b.args["threads"]) for b in benches] == [
        (s, t) for s in bg.SIZES for t in bg.THREADS
    ]
    for b in benches:
        look = bg._look(b)
        assert (
            "tokens/s" in look.what
            and "per second" in look.ylabel
            and b.line_names == ["overlap", "sync", "hf", "hf_cb"]
        )
    same = {"overlap": [[1, 2]], "sync": [[1, 2]], "hf": [[1, 2]]}
    bg.check_tokens(None, [[5]], 2, same)  # the padded batch agrees: nothing more runs
    monkeypatch.setattr(bg, "hf_run", lambda model, ps, new: (0.0, [[1, 3]]))
    with pytest.raises(AssertionError, match="request 0"):
        bg.check_tokens(None, [[5]], 2, same | {"hf": [[9, 9]]})
    with pytest.raises(AssertionError, match="overlap and sync"):
        bg.check_tokens(None, [[5]], 2, same | {"sync": [[1, 3]]})
    monkeypatch.setattr(bg, "hf_run", lambda model, ps, new: (0.0, [[1, 2]]))
    bg.check_tokens(None, [[5]], 2, same | {"hf": [[9, 9]]})  # unpadded HF agrees


def test_bench_generate_hf_cb_line_gives_hf_tokens_or_says_why_it_is_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hf_cb line (``model.generate_batch``, its cache sized for the batch) gives the padded
    ``generate``'s greedy tokens on a small model; where it fails, the line is NaN and the first
    reason is kept for summary.json and meta.json."""
    pytest.importorskip("transformers")
    import math

    from perf import bench_generate as bg
    from tfuture.examples.hf import build_llama

    monkeypatch.setattr(bg, "CB_SKIPPED", [])
    model = build_llama()
    ps = [[5, 6, 7], [8, 9, 10, 11, 12]]
    with torch.inference_mode():
        rate, tokens = bg.hf_cb_run(model, ps, 3)
        if bg.CB_SKIPPED:
            pytest.skip(f"this transformers' continuous batching does not run here: {bg.CB_SKIPPED[0]}")
        assert rate > 0 and tokens == [bg.hf_run(model, [p], 3)[1][0] for p in ps]

    class Broken:
        def generate_batch(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("planted")

    rate, tokens = bg.hf_cb_run(Broken(), ps, 3)
    assert math.isnan(rate) and tokens == [] and "planted" in bg.CB_SKIPPED[0]
    assert math.isnan(bg.hf_cb_run(model, ps, 3)[0])  # the first failure empties the line

    # generate_batch catches a failure itself and returns what it has: an error, short tokens.
    from transformers.generation.continuous_batching.requests import GenerationOutput

    class Caught:
        def generate_batch(self, *args: object, **kwargs: object) -> dict[str, object]:
            return {
                "req_0": GenerationOutput("req_0", generated_tokens=[1, 2, 3]),
                "req_1": GenerationOutput("req_1", generated_tokens=[4], error="planted in the loop"),
            }

    monkeypatch.setattr(bg, "CB_SKIPPED", [])
    rate, tokens = bg.hf_cb_run(Caught(), ps, 3)
    assert math.isnan(rate) and tokens == [] and "req_1: 1 of 3 tokens" in bg.CB_SKIPPED[0]
    assert "planted in the loop" in bg.CB_SKIPPED[0]


def test_bench_direct_plots_every_model_with_units() -> None:
    """One ms-per-step plot per model, lines modules and direct over its batches."""
    from perf import bench_direct as bd

    benches = bd.direct_report.benchmarks
    assert [b.args["size"] for b in benches] == bd.SIZES
    for b in benches:
        look = bd._look(b)
        assert b.line_names == ["modules", "direct"] and b.x_vals == bd.BATCHES[b.args["size"]]
        assert "ms per step" in look.what and "ms per step" in look.ylabel


def test_the_runtime_overhead_plot_bounds_the_runtime_by_the_contracts_floor() -> None:
    # Its contract line follows perf/contract.py (a re-based target once left it naming a gone path).
    from perf import bench_runtime_overhead as bench

    marks = bench.runtime_per_step.benchmarks
    looks = [bench.look(b) for b in (marks if isinstance(marks, list) else [marks])]
    labels = [r.label for look in looks for r in look.refs]
    assert labels and all("floor_" in label for label in labels)
