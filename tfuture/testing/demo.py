"""``python -m tfuture.testing.demo``: an overlapped workload against sync, with a timeline.

Runs the toy model with ``--t-dev`` ms of device work per step and host work of
``--ratios`` x T_dev per step, in sync and overlap mode, prints step times and the forward
stream's idle fraction, and writes the overlapped run's Chrome trace (open it in Perfetto).

With ``--tp N`` and/or ``--pp N`` it runs tensor / pipeline parallel on ``N`` ranks instead
(:mod:`tfuture.testing.demo_parallel`), launched by torchrun (gloo on CPU, NCCL on GPUs)::

    torchrun --nproc-per-node 2 -m tfuture.testing.demo --tp 2
    torchrun --nproc-per-node 2 -m tfuture.testing.demo --pp 2

(``torchrun`` is ``python -m torch.distributed.run``: use the latter, with the virtualenv's python,
when the virtualenv is not active.)
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from tfuture.streams.stats import RunStats
from tfuture.testing import RequestSpec, ToyModel, run_workload


def decode_workload(batch: int, steps: int) -> list[RequestSpec]:
    """``batch`` requests that all arrive at once and decode ``steps`` tokens (no end token)."""
    return [RequestSpec(i, 0, np.array([i + 1, 2, 3], dtype=np.int64), steps) for i in range(batch)]


def measure(
    t_dev: float, t_cpu: float, *, batch: int, steps: int, device: str, gil: bool
) -> tuple[RunStats, RunStats]:
    """Sync and overlap stats of one (T_dev, T_cpu) point, seconds."""
    runs = []
    for overlap in (False, True):
        _, stats, _, fmap = run_workload(
            ToyModel(work_s=t_dev),
            decode_workload(batch, steps),
            overlap=overlap,
            capacity=4 * batch,
            device=device,
            eos=-1,
            max_running=batch,
            token_budget=4 * batch,
            host_work_s=t_cpu,
            host_work_holds_gil=gil,
            trace=True,  # the device's busy and idle times
        )
        assert fmap.in_use == 0, "slots left in use at idle"
        runs.append(stats)
    return runs[0], runs[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tfuture.testing.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--t-dev", type=float, default=4.0, help="device work per step, ms")
    p.add_argument("--ratios", default="1,0.5", help="T_cpu / T_dev values, comma separated")
    p.add_argument("--batch", type=int, default=16, help="requests decoding at once")
    p.add_argument("--steps", type=int, default=100, help="tokens each request decodes")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: %(default)s)",
    )
    p.add_argument("--gil", action="store_true", help="host work holds the GIL (a Python spin)")
    p.add_argument("--trace", default="tfuture-trace.json", help="Chrome trace of the first overlapped run")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (launch with torchrun)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (launch with torchrun)")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, s (--tp/--pp)")
    args = p.parse_args(argv)
    if args.tp is not None or args.pp is not None:
        from tfuture.testing.demo_parallel import run_distributed_demo

        args.tp, args.pp = (1 if v is None else v for v in (args.tp, args.pp))
        if args.tp < 1 or args.pp < 1:
            p.error(f"--tp and --pp must be >= 1, got --tp {args.tp} --pp {args.pp}")
        return run_distributed_demo(args)
    t_dev = args.t_dev / 1e3
    print(f"device={args.device} batch={args.batch} steps={args.steps} host work holds GIL={args.gil}")
    cols = ["T_cpu/T_dev", "sync ms", "overlap ms", "max(Tc,Td)", "speedup", "idle sync", "idle ovl"]
    print(" ".join(f"{c:>11}" for c in cols))
    for i, ratio in enumerate(float(r) for r in args.ratios.split(",")):
        sync, over = measure(
            t_dev, ratio * t_dev, batch=args.batch, steps=args.steps, device=args.device, gil=args.gil
        )
        # Ideal: the larger of the measured device time per step and the host time per step.
        t_dev_meas = sync.device_busy / max(sync.steps, 1)
        ideal = max(t_dev_meas, sync.step_time - t_dev_meas)
        row = [
            f"{ratio:.2f}",
            f"{sync.step_time * 1e3:.3f}",
            f"{over.step_time * 1e3:.3f}",
            f"{ideal * 1e3:.3f}",
            f"{sync.step_time / over.step_time:.2f}x",
            f"{100 * sync.idle_fraction:.1f}%",
            f"{100 * over.idle_fraction:.1f}%",
        ]
        print(" ".join(f"{c:>11}" for c in row))
        if i == 0 and args.trace:
            over.write_chrome_trace(args.trace)
    if args.trace:
        print(f"timeline of the first overlapped run: {args.trace} (open in https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
