"""What a run measured (``tfuture.streams.stats``): device busy and idle time from the stream's spans,
tokens/s, and the Chrome trace."""

import json

import numpy as np
import pytest

from tfuture.streams.backends import Span
from tfuture.streams.base import SpanLog
from tfuture.streams.stats import RunStats
from tfuture.testing import RequestSpec, ToyModel, run_workload


def test_account_sums_busy_time_and_the_gaps_between_ops():
    # Steps 0 and 1: a gap of 0.5 s before step 1's first op; an overlapping op is not idle.
    spans = [Span("prepare", 0, 0.0, 1.0), Span("forward", 0, 0.5, 2.0), Span("prepare", 1, 2.5, 3.0)]
    stats = RunStats("overlap", steps=2, tokens=8, wall=4.0, device_spans=spans)
    stats.account()
    assert stats.device_busy == pytest.approx(3.0)
    assert stats.device_idle == pytest.approx(0.5) and stats.idle_per_step == {1: pytest.approx(0.5)}
    assert stats.idle_fraction == pytest.approx(0.5 / 3.5)
    assert (stats.step_time, stats.tokens_per_s) == (2.0, 2.0)
    assert "overlap: 2 steps" in stats.summary() and "device idle 14.3%" in stats.summary()
    empty = RunStats("sync")
    empty.account()
    assert (empty.idle_fraction, empty.step_time, empty.tokens_per_s) == (0.0, 0.0, 0.0)


def test_bubble_accounting_and_trace(tmp_path):
    specs = [RequestSpec(i, 0, np.array([i + 1, 2]), 6) for i in range(4)]
    _, stats, _, _ = run_workload(
        ToyModel(vocab=64, work_s=1e-3), specs, overlap=True, capacity=16, eos=-1, trace=True
    )
    names = {s.name for s in stats.device_spans}
    assert {"prepare", "forward", "sample", "copy"} <= names
    assert stats.steps == 6 and stats.device_busy > 6e-3
    assert 0.0 <= stats.idle_fraction < 1.0
    assert all(s.end >= s.start for s in stats.device_spans)
    path = tmp_path / "trace.json"
    stats.write_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_a_span_log_reads_back_as_spans_and_accounts_like_them():
    """The hot path records into a SpanLog; the Spans made from it, and the device totals
    accounted on it, equal those of the same spans as a list (the ops out of start order)."""
    spans = [
        Span("forward", 0, 0.5, 2.0),
        Span("prepare", 0, 0.0, 1.0),
        Span("prepare", 1, 2.5, 3.0),
        Span("sample", 1, 3.25, 3.5),
        Span("copy", 2, 4.0, 4.5),
    ]
    log = SpanLog()
    for s in spans:
        log.add(*s)
    assert len(log) == 5 and log.spans() == spans
    assert all(type(s.step) is int for s in log.spans())
    from_log = RunStats("overlap", steps=3, device_spans=log, host_spans=SpanLog())
    from_list = RunStats("overlap", steps=3, device_spans=list(spans))
    from_log.account()
    from_list.account()
    assert from_log.device_busy == pytest.approx(from_list.device_busy) == pytest.approx(3.75)
    assert from_log.device_idle == pytest.approx(from_list.device_idle) == pytest.approx(1.25)
    assert from_log.idle_per_step == pytest.approx(from_list.idle_per_step)
    assert from_log.idle_per_step == pytest.approx({1: 0.75, 2: 0.5})
    assert from_log.device_spans == spans and from_log.host_spans == []
    assert "5 spans" in repr(from_log)


def test_a_span_log_reads_chains_of_back_to_back_ops_in_start_order():
    """A stream records a step's ops as a chain (its start, then each op's end); a failed first
    op leaves an empty chain; single spans (``add``) merge with the chains in start order."""
    log = SpanLog()
    log.chains.extend((0, 1.0, len(log.links)))
    log.links.extend(("prepare", 1.5, "forward", 3.0, "copy", 3.25))
    log.add("debug", -1, 3.5, 3.75)
    log.chains.extend((1, 4.0, len(log.links)))  # its first op failed: no op ended
    log.chains.extend((2, 5.0, len(log.links)))
    log.links.extend(("prepare", 5.5))
    want = [
        Span("prepare", 0, 1.0, 1.5),
        Span("forward", 0, 1.5, 3.0),
        Span("copy", 0, 3.0, 3.25),
        Span("debug", -1, 3.5, 3.75),
        Span("prepare", 2, 5.0, 5.5),
    ]
    assert len(log) == 5 and log.spans() == want
    steps, starts, ends = log.columns()
    assert steps.tolist() == [0, 0, 0, -1, 2] and starts.tolist() == [s.start for s in want]
    assert ends.tolist() == [s.end for s in want]
    stats = RunStats("overlap", device_spans=log)
    stats.account()
    assert stats.device_busy == pytest.approx(3.0) and stats.device_idle == pytest.approx(1.5)
    assert stats.idle_per_step == pytest.approx({-1: 0.25, 2: 1.25})


def test_a_runs_device_totals_follow_its_spans_when_read():
    """A run hands its spans over unaccounted; the totals read afterwards are those of the spans
    (as ``account()`` makes them), and new spans are accounted again when read."""
    specs = [RequestSpec(i, 0, np.array([i + 1, 2]), 4) for i in range(3)]
    _, stats, _, _ = run_workload(
        ToyModel(vocab=64, work_s=1e-3), specs, overlap=True, capacity=16, eos=-1, trace=True
    )
    busy, idle, per_step = stats.device_busy, stats.device_idle, dict(stats.idle_per_step)
    assert busy == pytest.approx(sum(s.end - s.start for s in stats.device_spans)) and busy > 4e-3
    again = RunStats("overlap", device_spans=list(stats.device_spans))
    again.account()
    assert (again.device_busy, again.device_idle, again.idle_per_step) == (busy, idle, per_step)
    given = RunStats("sync", device_busy=2.0, device_idle=1.0, idle_per_step={0: 1.0})
    assert (given.device_busy, given.device_idle, given.idle_per_step) == (2.0, 1.0, {0: 1.0})
    given.device_spans = [Span("prepare", 0, 0.0, 1.0), Span("forward", 1, 1.5, 2.0)]
    assert (given.device_busy, given.device_idle) == (pytest.approx(1.5), pytest.approx(0.5))
    assert given.idle_per_step == pytest.approx({1: 0.5})
