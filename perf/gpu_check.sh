#!/usr/bin/env bash
# The one prepared check for a GPU session: the test suite on CUDA, then the full
# `python -m perf --refresh`, which rewrites perf/results/<device>/ (h200 on an H200).
# Run from anywhere on the GPU machine: `bash perf/gpu_check.sh`. Uses the image's python3 (torch
# and triton preinstalled, no registry: no pip). Logs are teed into $OUT as they are written.
# The device tool returns at most 8 files from $OUT, so perf/results/<device>/ comes back as
# one tarball plus its summary.json, meta.json and README.md:
#   tar -xzf results_<device>.tgz -C perf/results
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
unset TRITON_INTERPRET CI
OUT="${OUT:-/tmp/tfuture-gpu-out}"
mkdir -p "$OUT"
PY=python3

{
  nvidia-smi -L || true
  $PY -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.log"

# The whole suite on CUDA: the kernel, map and runtime tests pick the cuda device when present,
# and the gpu-marked tests run too. Its own time limit leaves the perf sweep its share.
# pytest-xdist and pytest-timeout are in the image: 8 workers, and no test may hang the check.
# Two torch threads per worker: at the default (16 each) the CPU-model tests of 8 workers
# oversubscribed the 16 cores (a rerun of the speculative files did 67 tests in 80 s).
# The time limits fit a 15-minute device session with the machine's start (about 90 s):
# call the device tool with timeout_s of about 620.
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n ${PYTEST_WORKERS:-8}"
OMP_NUM_THREADS="${PYTEST_THREADS:-2}" timeout "${TEST_TIMEOUT_S:-220}" $PY -m pytest -q -p no:cacheprovider $XDIST --timeout 120 --continue-on-collection-errors tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log"
test_rc=${PIPESTATUS[0]}

# tfuture.distributed over NCCL with the GPUs found (one GPU: TP=1 through the same code path).
timeout "${NCCL_TIMEOUT_S:-60}" $PY -m perf.nccl_smoke 2>&1 | tee "$OUT/nccl_smoke.log"
nccl_rc=${PIPESTATUS[0]}

# A time limit of our own, so that a slow run still leaves its partial results to pack.
# PERF_ARGS names sweeps to run (default: all, in perf/__main__.py's order; at 43f1342 the
# kernel to grammar sweeps took about 245 s on the H200 and the end-to-end ones did not fit):
#   PERF_ARGS="bench_hf bench_generate bench_spec" bash perf/gpu_check.sh
timeout "${PERF_TIMEOUT_S:-320}" $PY -m perf --refresh ${PERF_ARGS:-} 2>&1 | tee "$OUT/perf.log"
perf_rc=${PIPESTATUS[0]}

dev=$($PY -c 'from perf.harness import device_slug; print(device_slug())')
if [ -n "$dev" ] && [ -d "perf/results/$dev" ]; then
  tar -C perf/results -czf "$OUT/results_$dev.tgz" "$dev"
  for f in summary.json meta.json README.md; do
    [ -f "perf/results/$dev/$f" ] && cp "perf/results/$dev/$f" "$OUT/"
  done
fi
echo "gpu_check: pytest rc=$test_rc, nccl smoke rc=$nccl_rc, perf rc=$perf_rc, results in $OUT (device $dev)" \
  | tee -a "$OUT/perf.log"
[ "$test_rc" -eq 0 ] && [ "$nccl_rc" -eq 0 ] && [ "$perf_rc" -eq 0 ]
