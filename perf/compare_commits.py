"""Host cost per step and per bookkeeping cycle at two commits, interleaved, on this machine.

    python -m perf.compare_commits fb81499 HEAD      # base, then the commit to judge

Each commit is checked out into a temporary git worktree; a child process imports tfuture from
there (``PYTHONPATH``) and times, on one torch thread, host-thread CPU (``time.thread_time``):

* ``runtime``: ``OverlapRuntime(zero-work model, FutureMap, overlap=True, stream="inline",
  trace=False)`` driving a decode-only scheduler for 2,000 steps, at batch 16 and 64;
* ``cycle``: alloc, store, filter ~90%, cat with 8 prefill ids, resolve, release, at batch 1, 64,
  256 and 1024 (the ``tfuture`` line of ``bench_host_cycle``).

The commits alternate ``--repeats`` times; the medians and their ratio are printed. Only the
public API is used, so commits from before and after the package's regrouping both work.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, time
import numpy as np, torch
torch.set_num_threads(1)
root = sys.argv[1]
sys.path.insert(0, root)
import tfuture
assert tfuture.__file__.startswith(root), tfuture.__file__
from tfuture.runtime import OverlapRuntime
try:
    from tfuture.batch import Batch
except ImportError:
    from tfuture.core.batch import Batch

class ZeroModel:
    def __init__(self, n):
        self.logits = torch.zeros(n, 2)
    def forward(self, batch):
        return self.logits[: batch.sample_rows.numel()]
    def sample(self, logits, batch, mask):
        return logits.argmax(dim=1)

class Decode:
    def __init__(self, n):
        self.ones, self.ids = np.ones(n, np.int64), np.arange(n, dtype=np.int64)
        self.sample, self.pos = np.ones(n, bool), np.full(n, 3, np.int64)
        self.tokens, self.last = np.arange(1, n + 1, dtype=np.int64), None
    def schedule(self):
        consumes, tokens = [], self.tokens
        if self.last is not None and self.last.out is not None:
            kept = self.last.out.filter(self.sample)
            consumes, tokens = [kept], kept.host_placeholders()
        b = Batch(tokens, self.ones, self.pos.copy(), self.ids, self.sample, consumes=consumes)
        self.pos += 1
        self.last = b
        return b
    def process(self, result):
        self.tokens = result.tokens
        if result.batch is self.last:
            self.last = None
    def build_mask(self, batch):
        return None

out = {}
for n in (16, 64):
    fmap = tfuture.FutureMap(4 * n + 64, device="cpu")
    rt = OverlapRuntime(ZeroModel(n), fmap, overlap=True, stream="inline", trace=False)
    def go(steps):
        rt.run(Decode(n), max_steps=steps)
        getattr(rt, "close", lambda: None)()
    go(200)
    t = time.thread_time(); go(2000)
    out[f"runtime us/step, batch {n}"] = (time.thread_time() - t) / 2000 * 1e6
for n in (1, 64, 256, 1024):
    fmap = tfuture.FutureMap(4 * n + 64, device="cpu")
    g = torch.Generator().manual_seed(n)
    tokens, prefill = torch.randint(0, 32000, (n,), generator=g), torch.randint(0, 32000, (8,), generator=g)
    keep = np.ones(n, dtype=bool)
    keep[: n - max(1, int(0.9 * n))] = False
    def cycle():
        o = fmap.alloc(n)
        fmap.store(o, tokens)
        kept = o.filter(keep)
        fmap.resolve(torch.cat([kept.placeholders(), prefill]))
        fmap.release(o)
        fmap.release(kept)
    for _ in range(200):
        cycle()
    t = time.thread_time()
    for _ in range(2000):
        cycle()
    out[f"cycle us, batch {n}"] = (time.thread_time() - t) / 2000 * 1e6
print(out)
"""


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.compare_commits", description=__doc__.split("\n")[0])
    ap.add_argument("base", help="the commit to compare against")
    ap.add_argument("new", help="the commit to judge")
    ap.add_argument("--repeats", type=int, default=5, help="runs per commit, alternating (default 5)")
    args = ap.parse_args()
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        roots = {}
        for name, rev in (("base", args.base), ("new", args.new)):
            roots[name] = str(Path(tmp) / name)
            subprocess.run(
                ["git", "-C", str(repo), "worktree", "add", "--detach", "-f", roots[name], rev],
                check=True,
                capture_output=True,
            )
        try:
            runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
            for _ in range(args.repeats):
                for name, root in roots.items():
                    r = subprocess.run(
                        [sys.executable, "-c", CHILD, root],
                        capture_output=True,
                        text=True,
                        cwd=root,
                        env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"},
                    )
                    if r.returncode:
                        print(r.stderr[-3000:], file=sys.stderr)
                        return 1
                    runs[name].append(ast.literal_eval(r.stdout.strip().splitlines()[-1]))
        finally:
            for root in roots.values():
                subprocess.run(
                    ["git", "-C", str(repo), "worktree", "remove", "--force", root], capture_output=True
                )
    print(f"{'host-thread CPU, median of ' + str(args.repeats):<34} {args.base:>10} {args.new:>10}  new/base")
    for key in runs["base"][0]:
        b = statistics.median(d[key] for d in runs["base"])
        n = statistics.median(d[key] for d in runs["new"])
        print(f"{key:<34} {b:>10.1f} {n:>10.1f}  {n / b:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
