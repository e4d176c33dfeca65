#!/usr/bin/env bash
# The GPU record in one prepared call (docs/tests.md#the-gpu-record-in-one-call): on a machine with a CUDA
# GPU, within a deadline and most valuable first, the `gpu` tests, the default step's profile (eager and
# graphed), its images/s with --cuda-graphs off and on, the benchmark's train and end-to-end sections, and the
# digits matrix; what did not fit is skipped and named at the end. Without a GPU: one line, exit status 2.
#
#   bash run_scripts/gpu_check.sh                       # tests profile graphs bench decode matrix, in order
#   bash run_scripts/gpu_check.sh bench matrix          # these parts, in the order named
#   GPU_CHECK_DRY_RUN=1 bash run_scripts/gpu_check.sh   # the commands and the deadline arithmetic only
#
# Environment: PYTHON (default .venv/bin/python where it runs, else python3, the GPU image's), GPU_CHECK_SECONDS
# (the deadline; default 540, one 10-minute call of the device tool with a minute to spare), OUT (the output
# folder, as the device tool sets it: everything is then packed into one archive beside the summary; default
# results/gpu-<kind>-<date>/), GPU_CHECK_DRY_RUN=1. The work is run_scripts/gpu_check.py's (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
flags=()
if [[ -n ${GPU_CHECK_SECONDS:-} ]]; then flags+=(--seconds "$GPU_CHECK_SECONDS"); fi
if [[ -n ${OUT:-} ]]; then flags+=(--out "$OUT" --pack); fi
if [[ ${GPU_CHECK_DRY_RUN:-0} == 1 ]]; then flags+=(--dry-run); fi
exec "$PYTHON" run_scripts/gpu_check.py ${flags[@]+"${flags[@]}"} "$@"
