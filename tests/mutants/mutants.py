"""The committed mutation set: hand-made defects the owning test folder must catch.

Each :class:`Mutant` replaces one snippet of one package file (the snippet must occur exactly
once, so the set goes stale, and ``tests/mutants/run.py`` fails, when someone edits the code
under it: update the record then). ``tests`` are the tests that kill it, all inside the folder
that owns the module (tests/core for core, tests/kernels for kernels, tests/runtime for the
runtime, streams and steps, tests/sampling, tests/models, tests/distributed). Every mutant is a
real behaviour change, none an equivalent rewrite. Like ``tests/defects.py``, nothing here
touches the package: the runner applies each mutant to a temporary copy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """``original`` (exactly once in ``path``) becomes ``replacement``; ``tests`` must fail."""

    id: str
    path: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    description: str


K = "tests/kernels/"
CPU_EDGES = (K + "test_cpu_path_edges.py",)
FENCE = (K + "test_bitmask_fence.py",)
MALFORMED = (K + "test_prepare_malformed.py",)
MAP_EDGES = ("tests/core/test_map_edges.py",)

MUTANTS: tuple[Mutant, ...] = (
    # ---------------------------------------------------------------- kernels: numpy path (cpu.py)
    Mutant(
        "cpu-resolve-fast-path-bound",
        "tfuture/kernels/cpu.py",
        "slots.min() >= 1 and slots.max() < token_map.size:",
        "slots.min() >= 1 and slots.max() <= token_map.size:",
        CPU_EDGES,
        "resolve's fast path takes a placeholder of exactly -n_slots as in range (IndexError)",
    ),
    Mutant(
        "cpu-store-range-low-end",
        "tfuture/kernels/cpu.py",
        "if not slots or (slots.start >= 1 and slots.stop <= n_slots):",
        "if not slots or (slots.start >= 0 and slots.stop <= n_slots):",
        CPU_EDGES,
        "an unchecked range starting at slot 0 writes the padding row, unflagged",
    ),
    Mutant(
        "cpu-slot-rows-bound",
        "tfuture/kernels/cpu.py",
        "if idx.min() >= 1 and idx.max() < n_slots:",
        "if idx.min() >= 1 and idx.max() <= n_slots:",
        CPU_EDGES,
        "an index naming slot n_slots next to good ones skips the bounds mask",
    ),
    Mutant(
        "cpu-resolve-bad-kept",
        "tfuture/kernels/cpu.py",
        "        _flag(err, np.ones(bad.size, dtype=bool), ids[bad])\n        ids[bad] = 0\n",
        "        _flag(err, np.ones(bad.size, dtype=bool), ids[bad])\n",
        (K + "test_resolve.py",),
        "a bad placeholder is flagged but stays in ids instead of becoming 0",
    ),
    Mutant(
        "cpu-prepare-last-rows-clamp",
        "tfuture/kernels/cpu.py",
        "last[:] = np.maximum(np.minimum(seg[1:], total) - 1, 0)",
        "last[:] = np.minimum(seg[1:], total) - 1",
        (K + "test_prepare.py",),
        "an empty segment at row 0 gets last row -1 instead of 0",
    ),
    Mutant(
        "cpu-gather-bad-rows-kept",
        "tfuture/kernels/cpu.py",
        "        if ok is not None:\n            words[~ok] = 0\n",
        "",
        (K + "test_fields.py",),
        "gather of a bad slot returns the padding row's words instead of zeros",
    ),
    Mutant(
        "cpu-spec-accept-clamp",
        "tfuture/kernels/cpu.py",
        "acc = np.clip(accept_len.numpy()[safe], 1, n_tok)",
        "acc = np.clip(accept_len.numpy()[safe], 0, n_tok)",
        (K + "test_spec.py",),
        "an accept_len of 0 reads the row's last token (index -1) instead of its first",
    ),
    Mutant(
        "cpu-bitmask-negative-row",
        "tfuture/kernels/cpu.py",
        "for i in np.flatnonzero((idx >= 0) & (idx < n)).tolist():",
        "for i in np.flatnonzero((idx >= -1) & (idx < n)).tolist():",
        (K + "test_bitmask.py",),
        "an unchecked bitmask row -1 masks the last logits row instead of being skipped",
    ),
    Mutant(
        "cpu-store-unfit-out-of-range",
        "tfuture/kernels/cpu.py",
        "        if ok is not None:\n            unfit &= ok\n",
        "",
        (K + "test_store.py",),
        "a negative value at a bad slot is counted twice in the error flag",
    ),
    Mutant(
        "cpu-prepare-seg0-unflagged",
        "tfuture/kernels/cpu.py",
        "        _flag(err, seg[:1] != 0, -np.abs(seg[:1]))\n",
        "",
        MALFORMED,
        "a nonzero seg_starts[0] is not counted in the error flag",
    ),
    Mutant(
        "cpu-search-midpoint",
        "tfuture/kernels/cpu.py",
        "        mid = (lo + hi + 1) // 2\n        go = seg[np.where(active, mid, 0)] <= rows",
        "        mid = (lo + hi) // 2\n        go = seg[np.where(active, mid, 0)] <= rows",
        MALFORMED,
        "the numpy twin of the kernel's binary search (malformed segments) rounds its midpoint down",
    ),
    Mutant(
        "cpu-prepare-fit32-tokens",
        "tfuture/kernels/cpu.py",
        "narrows(out[0].dtype, tokens.dtype, token_map.dtype)",
        "narrows(out[0].dtype, token_map.dtype)",
        MALFORMED,
        "the numpy prepare wraps int64 concrete ids past int32 into an int32 output (int32 map)",
    ),
    Mutant(
        "cpu-bitmask-row-past-the-end",
        "tfuture/kernels/cpu.py",
        "for i in np.flatnonzero((idx >= 0) & (idx < n)).tolist():",
        "for i in np.flatnonzero((idx >= 0) & (idx <= n)).tolist():",
        FENCE,
        "the numpy bitmask apply takes an unchecked row n (one past the logits)",
    ),
    # ---------------------------------------------------------------- kernels: Triton kernels
    Mutant(
        "common-in-range-slot-0",
        "tfuture/kernels/_common.py",
        "return (slots >= 1) & (slots < n_slots)",
        "return (slots >= 0) & (slots < n_slots)",
        (K + "test_store.py",),
        "every kernel takes slot 0 (the padding row) as a real slot",
    ),
    Mutant(
        "resolve-bad-kept",
        "tfuture/kernels/resolve.py",
        "out = tl.where(bad, tl.zeros_like(ids), out)",
        "out = tl.where(bad, ids, out)",
        (K + "test_resolve.py",),
        "the kernel flags a bad placeholder but leaves it in ids",
    ),
    Mutant(
        "prepare-last-rows-clamp",
        "tfuture/kernels/resolve.py",
        "last = tl.maximum(tl.minimum(seg_end, total) - 1, 0)",
        "last = tl.minimum(seg_end, total) - 1",
        (K + "test_prepare.py",),
        "the kernel gives an empty first segment last row -1",
    ),
    Mutant(
        "prepare-search-midpoint",
        "tfuture/kernels/resolve.py",
        "        mid = (lo + hi + 1) // 2\n        start = tl.load(",
        "        mid = (lo + hi) // 2\n        start = tl.load(",
        (K + "test_prepare.py",),
        "the kernel's binary search rounds its midpoint down (rows get the wrong request)",
    ),
    Mutant(
        "prepare-fit32-tokens",
        "tfuture/kernels/resolve.py",
        "        tokens_ptr.dtype.element_ty == tl.int64 or map_ptr.dtype.element_ty == tl.int64\n",
        "        map_ptr.dtype.element_ty == tl.int64\n",
        MALFORMED,
        "int64 concrete tokens into int32 input_ids (int32 map) wrap instead of being flagged",
    ),
    Mutant(
        "store-flag-padding-lanes",
        "tfuture/kernels/store.py",
        "flag_bad(err_ptr, (mask & ~ok) | unfit, worst, BLOCK=BLOCK)",
        "flag_bad(err_ptr, ~ok | unfit, worst, BLOCK=BLOCK)",
        (K + "test_store.py",),
        "the store kernel counts the block's padding lanes as bad slots",
    ),
    Mutant(
        "store-unfit-out-of-range",
        "tfuture/kernels/store.py",
        "        unfit = ok & unfit\n",
        "        unfit = mask & unfit\n",
        (K + "test_store.py",),
        "a negative value at a bad slot reports the value, not -slot, in err[1]",
    ),
    Mutant(
        "fields-gather-bad-rows-kept",
        "tfuture/kernels/fields.py",
        "src_rows, dst_rows, src_ok, dst_ok = slots, rows, ok, live",
        "src_rows, dst_rows, src_ok, dst_ok = slots, rows, ok, ok",
        (K + "test_fields.py",),
        "the gather kernel leaves the output rows of bad slots unwritten instead of zero",
    ),
    Mutant(
        "fields-checked-store-trusts-slots",
        "tfuture/kernels/fields.py",
        "        cpu.store_fields(buffers, slots, values, negated, err)\n",
        "        cpu.store_fields(buffers, slots, values, negated, err, in_range=True)\n",
        CPU_EDGES,
        "the checked store_fields skips the bounds check on the numpy path",
    ),
    Mutant(
        "spec-accept-clamp",
        "tfuture/kernels/spec.py",
        "acc = tl.minimum(tl.maximum(acc, 1), N_TOK)",
        "acc = tl.minimum(acc, N_TOK)",
        (K + "test_spec.py",),
        "the spec kernel reads token acc - 1 = -1 (the previous slot's row) for accept_len 0",
    ),
    Mutant(
        "spec-drafts-of-bad-placeholder",
        "tfuture/kernels/spec.py",
        "tl.store(ndraft_out_ptr + rows, tl.where(ok, K, 0)",
        "tl.store(ndraft_out_ptr + rows, tl.where(future, K, 0)",
        (K + "test_spec.py",),
        "a placeholder outside the map reports k drafts",
    ),
    Mutant(
        "bitmask-row-past-the-end",
        "tfuture/kernels/bitmask.py",
        "limit = tl.where((row >= 0) & (row < n_logits_rows), vocab, 0)",
        "limit = tl.where((row >= 0) & (row <= n_logits_rows), vocab, 0)",
        FENCE,
        "the kernel writes an unchecked row == n, one row past the logits",
    ),
    Mutant(
        "bitmask-token-past-vocab",
        "tfuture/kernels/bitmask.py",
        "write = (bits == 0) & (offs < limit)",
        "write = (bits == 0) & (offs <= limit)",
        FENCE,
        "the kernel writes token vocab (the next row's first logit, or past the end)",
    ),
    Mutant(
        "bitmask-empty-rows-tail",
        "tfuture/kernels/bitmask.py",
        "allows |= words[:, full] & np.int32((1 << tail) - 1)",
        "allows |= words[:, full] & np.int32((1 << (tail + 1)) - 1)",
        (K + "test_bitmask.py",),
        "empty_bitmask_rows counts the first padding bit as an allowed token",
    ),
    # ---------------------------------------------------------------- core: slots and the map
    Mutant(
        "slots-retain-duplicates",
        "tfuture/core/slots.py",
        "        if distinct:\n            self._refs[slots] += 1\n",
        "        if True:\n            self._refs[slots] += 1\n",
        ("tests/core/test_slots.py",),
        "retain takes one reference per distinct slot for a handle that names a slot twice",
    ),
    Mutant(
        "slots-unref-duplicates",
        "tfuture/core/slots.py",
        "freed = _unique(slots[refs[slots] == 0])",
        "freed = slots[refs[slots] == 0]",
        ("tests/core/test_slots.py",),
        "a freed slot named twice by a handle is counted twice off in_use",
    ),
    Mutant(
        "slots-filter-index-dups",
        "tfuture/core/slots.py",
        "            slots = self._array()[idx]\n            dups = None\n",
        "            slots = self._array()[idx]\n            dups = self._dups\n",
        ("tests/core/test_slots.py",),
        "an index filter that repeats a row claims a duplicate-free handle",
    ),
    Mutant(
        "slots-cat-dups",
        "tfuture/core/slots.py",
        "            dups = None if parts else False\n",
        "            dups = False\n",
        ("tests/core/test_slots.py",),
        "cat of handles that name the same slot claims a duplicate-free result",
    ),
    Mutant(
        "slots-generations-alias",
        "tfuture/core/slots.py",
        "            gens = g.copy()\n",
        "            gens = g\n",
        MAP_EDGES,
        "a fresh run's generations alias the pool's: a stale handle follows the reuse unseen",
    ),
    Mutant(
        "slots-release-not-marked",
        "tfuture/core/slots.py",
        "        self._released = True\n        n = self._n\n",
        "        n = self._n\n",
        ("tests/core/test_slots.py", "tests/core/test_futures.py"),
        "release does not mark the handle released (a second release drops references again)",
    ),
    Mutant(
        "slots-unref-run-count",
        "tfuture/core/slots.py",
        "pool._in_use -= n - int(_count_nonzero(run))",
        "pool._in_use -= n",
        ("tests/core/test_slots.py",),
        "releasing a fresh run counts every slot free, even those another handle still names",
    ),
    Mutant(
        "map-store-duplicates",
        "tfuture/core/future_map.py",
        "        if fi._dups is not False and fi.has_duplicates():\n",
        "        if False:\n",
        ("tests/core/test_slots.py", "tests/core/test_futures.py"),
        "store accepts a handle that names a slot twice",
    ),
    Mutant(
        "map-check-keeps-flag",
        "tfuture/core/future_map.py",
        "        flags = self.err.tolist()\n        self.err.zero_()\n",
        "        flags = self.err.tolist()\n",
        ("tests/core/test_futures.py",),
        "check() does not reset the error flag after reading it",
    ),
    Mutant(
        "map-resolve-unflagged",
        "tfuture/core/future_map.py",
        "launch_resolve_(ids, self.token_map, self.err)\n        checks.after_read(ids)\n"
        "        return ids\n\n    def launch_resolve(",
        "launch_resolve_(ids, self.token_map, None)\n        checks.after_read(ids)\n"
        "        return ids\n\n    def launch_resolve(",
        ("tests/core/test_futures.py",),
        "FutureMap.resolve passes no error flag: a bad placeholder is never reported",
    ),
    Mutant(
        "map-fits-int32-max",
        "tfuture/core/future_map.py",
        "if lo < INT32_MIN or hi > INT32_MAX:",
        "if lo < INT32_MIN or hi >= INT32_MAX:",
        ("tests/core/test_misuse.py",),
        "storing the int32 maximum into an int32 map is refused",
    ),
    Mutant(
        "map-store-indexed-unflagged",
        "tfuture/core/future_map.py",
        "launch_store(self.token_map, dev_slots, tokens, self.err)",
        "launch_store(self.token_map, dev_slots, tokens, None)",
        MAP_EDGES,
        "a store through a non-contiguous handle does not flag negative tokens",
    ),
    # ---------------------------------------------------------------- runtime, streams, steps
    Mutant(
        "runtime-release-consumes-before-prepare",
        "tfuture/runtime.py",
        "        delayed = rec.delayed = plan.delayed\n",
        "        fmap.release_live(consumes)\n        delayed = rec.delayed = plan.delayed\n",
        ("tests/runtime/test_release_order.py",),
        "consumed handles are released before the prepare that reads them is enqueued",
    ),
    Mutant(
        "runtime-delayed-sample-before-process",
        "tfuture/runtime.py",
        "            if prev is not None:\n                self._finish(prev, scheduler, stats)\n"
        "            if cur.delayed:\n                self._delayed_sample(scheduler, cur)\n",
        "            if cur.delayed:\n                self._delayed_sample(scheduler, cur)\n"
        "            if prev is not None:\n                self._finish(prev, scheduler, stats)\n",
        ("tests/runtime/test_runtime.py::test_grammar_obeyed_under_overlap_with_delays",),
        "a delayed step's mask is built before the previous step was processed",
    ),
    Mutant(
        "runtime-process-failure-leaks-out",
        "tfuture/runtime.py",
        "            if not out.released:\n                fmap.release(out)\n            raise\n",
        "            raise\n",
        ("tests/runtime/test_runtime.py::test_failure_surfaces_and_loop_stops_cleanly",),
        "an exception in process() leaks the step's out slots",
    ),
    Mutant(
        "runtime-deferred-release",
        "tfuture/runtime.py",
        "if kind.keeps_out and self._step <= rec.step + 1:",
        "if False:",
        ("tests/runtime/test_speculative.py", "tests/runtime/test_spec_faults.py"),
        "a speculative step's slots are released while the next step still names them",
    ),
    Mutant(
        "runtime-bad-consumes-leak",
        "tfuture/runtime.py",
        "            fmap.release_live([g for g in consumes if isinstance(g, FutureIndices) "
        "and g.pool is fmap])\n",
        "            pass\n",
        ("tests/runtime/test_misuse_runtime.py",),
        "a batch with one bad consumes entry leaks the valid handles it handed over",
    ),
    Mutant(
        "staging-no-wait",
        "tfuture/streams/staging.py",
        "        if marker is not None and not marker.done:\n            stream.wait(marker)\n",
        "",
        ("tests/runtime/test_staging_ring.py",),
        "a staging buffer is handed out again before its last copy ran",
    ),
    Mutant(
        "staging-no-rotation",
        "tfuture/streams/staging.py",
        "self._next = (self._next + 1) % len(self._bufs)",
        "self._next = self._next % len(self._bufs)",
        ("tests/runtime/test_staging_ring.py",),
        "the ring hands out its first buffer every time (each step waits for the last copy)",
    ),
    Mutant(
        "staging-grow-short",
        "tfuture/streams/staging.py",
        "if buf.data.numel() < n:",
        "if buf.data.numel() < n - 1:",
        ("tests/runtime/test_staging_ring.py",),
        "a buffer one element too small is handed out",
    ),
    Mutant(
        "token-delayed-non-sampling",
        "tfuture/steps/token.py",
        "        n_waits = int(count_nonzero(waits))\n",
        "        n_waits = int(count_nonzero(batch.delayed))\n",
        ("tests/runtime/test_delayed_decision.py",),
        "a delayed entry of a request that does not sample delays the step",
    ),
    Mutant(
        "token-split-rows-swapped",
        "tfuture/steps/token.py",
        "return rows[waits], rows[~waits], rows[waits]",
        "return rows[~waits], rows[waits], rows[waits]",
        ("tests/runtime/test_delayed_decision.py",),
        "the rows that wait for the mask and the rows that sample at once are swapped",
    ),
    Mutant(
        "token-bucket-fit",
        "tfuture/steps/token.py",
        "            if b >= n:\n",
        "            if b > n:\n",
        ("tests/runtime/test_delayed_decision.py",),
        "a step that fills a bucket exactly is padded to the next one",
    ),
    # ---------------------------------------------------------------- sampling
    Mutant(
        "sampler-top-p-tie",
        "tfuture/sampling/sampler.py",
        "p = p.masked_fill(c - p >= floats[R_TOP_P].unsqueeze(1) * c[:, -1:], 0)",
        "p = p.masked_fill(c - p > floats[R_TOP_P].unsqueeze(1) * c[:, -1:], 0)",
        ("tests/sampling/test_sampler_ties.py",),
        "top-p keeps a token whose preceding mass already equals top_p exactly",
    ),
    Mutant(
        "sampler-top-k-one-more",
        "tfuture/sampling/sampler.py",
        "self._columns(vocab, x.device) >= top_k.unsqueeze(1)",
        "self._columns(vocab, x.device) > top_k.unsqueeze(1)",
        ("tests/sampling/test_sampler.py",),
        "top-k keeps k + 1 tokens",
    ),
    Mutant(
        "sampler-min-p-tie",
        "tfuture/sampling/sampler.py",
        "p = p.masked_fill(p < floats[R_MIN_P].unsqueeze(1) * p[:, :1], 0)",
        "p = p.masked_fill(p <= floats[R_MIN_P].unsqueeze(1) * p[:, :1], 0)",
        ("tests/sampling/test_sampler.py",),
        "min-p drops a token exactly at the threshold (min_p=1 drops the top token too)",
    ),
    Mutant(
        "sampler-bitmask-in-place",
        "tfuture/sampling/sampler.py",
        "x = logits.to(work, copy=True)",
        "x = logits.to(work)",
        ("tests/sampling/test_sampler_ties.py",),
        "the bitmask is applied to the caller's float32 logits in place",
    ),
    Mutant(
        "history-repetition-direction",
        "tfuture/sampling/history.py",
        "torch.where(x > 0, x / r, x * r)",
        "torch.where(x > 0, x * r, x / r)",
        ("tests/sampling/test_sampling_penalties.py",),
        "the repetition penalty raises seen tokens instead of lowering them",
    ),
    Mutant(
        "history-reused-row-keeps-counts",
        "tfuture/sampling/history.py",
        "            self.counts.index_fill_(0, new, 0)\n",
        "",
        ("tests/sampling/test_sampling_penalties.py",),
        "a history row handed to a new request keeps the old request's counts",
    ),
    Mutant(
        "history-pending-marks-lost",
        "tfuture/sampling/history.py",
        "        for p in self._pending:\n            self.seen.index_put_",
        "        for p in self._pending[:0]:\n            self.seen.index_put_",
        ("tests/sampling/test_sampling_penalties.py",),
        "seen marks made before the tables existed (the first step's prompt) are dropped",
    ),
    # ---------------------------------------------------------------- models: the KV pool
    Mutant(
        "kv-max-len-boundary",
        "tfuture/models/kv_pool.py",
        "if kv_len > pool.max_len:",
        "if kv_len >= pool.max_len:",
        ("tests/models/test_kv_pool_bounds.py",),
        "a step reaching exactly max_len positions is refused",
    ),
    Mutant(
        "kv-release-leaks-rows",
        "tfuture/models/kv_pool.py",
        "        self._alloc.release(req_ids)\n",
        "        pass\n",
        ("tests/models/test_kv_pool_bounds.py",),
        "release gives no row back (the pool fills up with ended requests)",
    ),
    Mutant(
        "kv-mask-excludes-self",
        "tfuture/models/kv_pool.py",
        "mask = torch.arange(kv_len, device=dev)[None, None, :] <= last_key[:, :, None]",
        "mask = torch.arange(kv_len, device=dev)[None, None, :] < last_key[:, :, None]",
        ("tests/models/test_kv_pool_bounds.py",),
        "a token does not attend to its own key",
    ),
    # ---------------------------------------------------------------- distributed
    Mutant(
        "dist-delivers-own-step",
        "tfuture/distributed/step.py",
        "state.delivers = queue[0] if len(queue) > self.lag else None",
        "state.delivers = queue[0] if len(queue) >= self.lag else None",
        ("tests/distributed/test_multiprocess.py::test_pipeline_parallel_2_equals_single_rank",),
        "a pipeline's first step delivers before the pipe is full (its own micro-batch)",
    ),
    Mutant(
        "dist-first-stage-samples",
        "tfuture/distributed/step.py",
        "self.samples = ctx.is_last_stage and ctx.tp_rank == 0",
        "self.samples = ctx.tp_rank == 0",
        (
            "tests/distributed/test_multiprocess.py::test_sampling_params_penalties_and_grammar_equal_single_rank[1-2]",
        ),
        "a first pipeline stage also runs the sampler (its rows that sample at once: no logits there)",
    ),
    Mutant(
        "dist-empty-delivery-stored",
        "tfuture/distributed/step.py",
        "        if done is None or done.n_sample == 0:\n            return ops\n",
        "        if done is None:\n            return ops\n",
        ("tests/distributed/test_dist_edges.py",),
        "a step whose delivered micro-batch sampled nothing still takes and stores tokens",
    ),
    Mutant(
        "token-decode-last-rows",
        "tfuture/steps/token.py",
        "                inputs.prefix_lens,\n                inputs.seg_starts[:-1],\n",
        "                inputs.prefix_lens,\n                inputs.seg_starts[1:],\n",
        ("tests/models/test_hf.py", "tests/runtime/test_model_protocol.py"),
        "a decode step's last rows are shifted by one (each request samples its neighbour's logits)",
    ),
    Mutant(
        "token-decode-positions",
        "tfuture/steps/token.py",
        "                inputs.prefix_lens,\n                inputs.seg_starts[:-1],\n",
        "                inputs.seq_lens,\n                inputs.seg_starts[:-1],\n",
        ("tests/models/test_hf.py", "tests/runtime/test_model_protocol.py"),
        "a decode step's positions are one past the token's (prefix + 1)",
    ),
    Mutant(
        "runtime-trailing-empty-parts",
        "tfuture/runtime.py",
        "            if trailing > 0:\n                views += empties\n",
        "            if trailing > 0:\n                views += empties[1:]\n",
        ("tests/runtime/test_runtime.py",),
        "a step's staged inputs lose an empty part at their end",
    ),
)
