#!/usr/bin/env bash
# The digits demo (run_scripts/demo.sh) on this machine's GPU with every entry script and every opt level,
# O0 to O3 in fp16 and bf16: the runs RESULTS.md shows for a GPU (make figures RUNS=...). Each must end at
# 95% validation top-1 or more; the last lines list any that did not, or failed, and the exit status is then 1.
#
#   bash run_scripts/gpu_demo_matrix.sh                               # into results/runs/gpu-<date>/
#   LOGDIR=runs/gpu-check PYTHON=.venv/bin/python bash run_scripts/gpu_demo_matrix.sh --data-backend dali
#
# Extra arguments go to every run. About 10 runs of 8 short epochs: minutes on one GPU (about 26 s a run on
# an H200). MATRIX_DEADLINE (seconds since 1970, as `date +%s`): a run starts only while RUN_SECONDS (default
# 40) fit before it, the first only while FIRST_RUN_SECONDS (default 60) do: it also writes the digits and
# starts CUDA and cuDNN on a cold machine. The others are listed as not run, and the status is then 75
# (sysexits' EX_TEMPFAIL: run them again) unless a run failed (1). run_scripts/gpu_check.sh sets them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOGDIR=${LOGDIR:-results/runs/gpu-$(date +%Y-%m-%d)}
MIN_TOP1=${MIN_TOP1:-95}
MATRIX_DEADLINE=${MATRIX_DEADLINE:-}
RUN_SECONDS=${RUN_SECONDS:-40}
FIRST_RUN_SECONDS=${FIRST_RUN_SECONDS:-60}
for variable in MATRIX_DEADLINE RUN_SECONDS FIRST_RUN_SECONDS; do  # numbers only: bash arithmetic would run a $(command) in them
  if [[ -n ${!variable} && ! ${!variable} =~ ^[0-9]{1,12}$ ]]; then
    echo "gpu_demo_matrix.sh: error: $variable must be whole seconds, got '${!variable}'" >&2
    exit 2
  fi
done

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_demo_matrix.sh: error: no CUDA GPU is visible to $PYTHON" >&2
  exit 2
fi

names=()     # the runs that ended, checked below
crashed=()   # the runs that failed, with their exit status
late=()      # the runs not started: they would have ended past MATRIX_DEADLINE
EXTRA=("$@")
run() {  # run NAME SCRIPT [flags...]: a run that fails is noted, and the others still run
  local name=$1 script=$2 status=0 allowance=$RUN_SECONDS
  shift 2
  if (( ${#names[@]} + ${#crashed[@]} == 0 )); then allowance=$FIRST_RUN_SECONDS; fi  # none started yet
  if [[ -n $MATRIX_DEADLINE ]] && (( $(date +%s) + allowance > MATRIX_DEADLINE )); then
    late+=("$name")
    return
  fi
  echo "== $name: $script $*"
  PYTHON=$PYTHON LOGDIR=$LOGDIR SCRIPT=$script bash run_scripts/demo.sh --run-name "$name" "$@" \
    ${EXTRA[@]+"${EXTRA[@]}"} || status=$?
  if [[ $status == 0 ]]; then names+=("$name"); else crashed+=("$name (exit $status)"); fi
}

run nd imagenet_nd.py
run dp imagenet_dp.py
run ddp imagenet_ddp.py
run apex-O0 imagenet_ddp_apex.py --opt-level O0
for dtype in fp16 bf16; do
  for level in O1 O2 O3; do
    run "apex-$level-$dtype" imagenet_ddp_apex.py --opt-level "$level" --amp-dtype "$dtype"
  done
done

# The best validation top-1 of each run that ended, from its metrics.csv; then the runs that failed.
status=0
"$PYTHON" - "$LOGDIR" "$MIN_TOP1" ${names[@]+"${names[@]}"} <<'EOF' || status=1
import csv, sys
from pathlib import Path

logdir, least, names = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
short = []
for name in names:
    with open(logdir / name / "metrics.csv", newline="") as handle:
        best = max(float(row["top1"]) for row in csv.DictReader(handle) if row["split"] == "val")
    print(f"{name}: best val top-1 {best:.2f}%")
    if best < least:
        short.append(f"{name} ({best:.2f}%)")
if short:
    sys.exit(f"below {least:g}% validation top-1: {', '.join(short)}")
print(f"{len(names)} run(s) at {least:g}% or more: {logdir}")
EOF
if (( ${#crashed[@]} )); then
  echo "failed: ${crashed[*]}" >&2
  status=1
fi
if (( ${#late[@]} )); then
  echo "not run before the deadline: ${late[*]}"
  if [[ $status == 0 ]]; then status=75; fi
fi
exit "$status"
