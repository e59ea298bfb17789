"""StagingRing: buffers handed out in turn, each only after the copy that last used it ran, and
always large enough (tfuture.streams.staging), against a stream that records what it waited for."""

from __future__ import annotations

from typing import Any

import pytest

from tfuture import FutureMap
from tfuture.runtime import OverlapRuntime
from tfuture.streams.base import Marker
from tfuture.streams.staging import StagingRing, staging_layout
from tfuture.testing import ContinuousBatcher, ToyModel, random_workload


class RecordingStream:
    """Stands in for a ForwardStream: ``wait(marker)`` records the marker."""

    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait(self, marker: Any) -> None:
        self.waited.append(marker)


def test_buffers_are_handed_out_in_turn():
    ring, stream = StagingRing(3, False, "inputs"), RecordingStream()
    bufs = [ring.acquire(8, stream) for _ in range(3)]
    assert len({id(b) for b in bufs}) == 3
    assert ring.acquire(8, stream) is bufs[0] and ring.acquire(8, stream) is bufs[1]
    assert stream.waited == []  # no buffer had a copy in flight


def test_a_buffer_is_reused_only_after_its_last_copy():
    ring, stream = StagingRing(3, False, "outputs"), RecordingStream()
    markers = []
    for step in range(3):
        buf = ring.acquire(4, stream)
        buf.marker = marker = Marker(seq=step + 1)
        markers.append(marker)
    assert stream.waited == []
    ring.acquire(4, stream)  # buffer 0 again: step 0's copy must have run first
    assert stream.waited == [markers[0]]
    ring.acquire(4, stream)
    assert stream.waited == markers[:2]


def test_a_marker_born_complete_is_not_waited_for():
    ring, stream = StagingRing(3, False, "outputs"), RecordingStream()
    for _ in range(3):
        ring.acquire(4, stream).marker = Marker(done=True)  # the inline stream's
    ring.acquire(4, stream)
    assert stream.waited == []


def test_reset_forgets_the_markers_of_a_drained_stream():
    ring, stream = StagingRing(3, False, "inputs"), RecordingStream()
    for step in range(3):
        ring.acquire(4, stream).marker = Marker(seq=step + 1)
    ring.reset()
    ring.acquire(4, stream)
    assert stream.waited == []


def test_a_buffer_grows_to_at_least_what_is_asked():
    ring, stream = StagingRing(3, False, "inputs"), RecordingStream()
    first = ring.acquire(1, stream)
    n0 = first.data.numel()
    for _ in range(2):
        ring.acquire(1, stream)
    for n in (n0, n0 + 1, 3 * n0 + 1):
        buf = ring.acquire(n, stream)
        assert buf.data.numel() >= n and buf.array.size == buf.data.numel()
        buf.array[:n] = 7  # the numpy view is the same memory, large enough
        assert int(buf.data[n - 1]) == 7


def test_a_kept_head_view_follows_a_grown_buffer():
    """``Staging.head(n)`` keeps its view while ``n`` repeats; once the buffer grows, the view
    is of the new memory (the result copy writes there, the host reads ``array``)."""
    ring, stream = StagingRing(3, False, "outputs"), RecordingStream()
    buf = ring.acquire(2, stream)
    first = buf.head(2)
    assert buf.head(2) is first and first.data_ptr() == buf.data.data_ptr() and first.numel() == 2
    for _ in range(2):
        ring.acquire(2, stream)
    grown = ring.acquire(10 * buf.data.numel(), stream)
    assert grown is buf
    head = grown.head(2)
    head.fill_(5)
    assert head.data_ptr() == grown.data.data_ptr() and grown.array[:2].tolist() == [5, 5]
    assert grown.head(3).numel() == 3


def _outputs(staged_like_cuda: bool, overlap: bool, stream: str) -> dict[int, list[int]]:
    fmap = FutureMap(48, device="cpu")
    sched = ContinuousBatcher(random_workload(7, 12, vocab=64, max_new=9), fmap, max_running=5)
    delay = (lambda name: 2e-4 if name in ("prepare", "copy") else 0.0) if stream == "worker" else None
    rt = OverlapRuntime(ToyModel(vocab=64), fmap, overlap=overlap, stream=stream, delay=delay)
    # Test-only: the staging a CUDA map takes (pinned-ring stand-ins, the input copy on the
    # stream, two result copies), on a CPU map, whose own path stages in fresh arrays.
    rt._on_cpu = not staged_like_cuda
    rt.run(sched)
    assert fmap.in_use == 0
    return sched.outputs


@pytest.mark.parametrize("stream", ["worker", "inline"])
def test_the_cuda_staging_path_gives_the_cpu_paths_tokens(stream):
    """The input ring (acquire, pack, copy on the stream) and the two result copies are what a
    CUDA map runs; on a CPU map they must give the tokens of its own path, under overlap with a
    slow stream too (the ring waits for each buffer's last copy)."""
    want = _outputs(False, overlap=False, stream="inline")
    assert _outputs(True, overlap=True, stream=stream) == want
    assert _outputs(True, overlap=False, stream=stream) == want


def test_staging_layouts_pack_the_non_empty_parts_and_are_cached():
    cache: dict = {}
    # total words, cuts (each non-empty part's end but the last), non-empty parts, trailing empties
    assert staging_layout((3, 4, 0, 0), cache) == (7, (3,), 2, 2)
    assert staging_layout((3, 0, 4), cache) == (7, (3,), 2, -1)  # an empty part between two
    assert staging_layout((0, 0), cache) == (0, (), 0, 2)
    assert staging_layout((5,), cache) == (5, (), 1, 0)
    assert cache[(3, 0, 4)] == (7, (3,), 2, -1) and len(cache) == 4
    for n in range(1, 300):
        staging_layout((n, 1), cache)
    assert 1 <= len(cache) <= 256  # bounded: cleared when full
