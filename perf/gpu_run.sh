#!/usr/bin/env bash
# One pass of the GPU checks on a CUDA machine, for the phases named on the command line, in that
# order. Minutes are estimates for one H100 (the first run there took 43 s, 167 s on 14 workers,
# 13-108 s per benchmark, 27 s and 53 s for gpu, suite, bench, autotune and e2e):
#   env       1   nvidia-smi, versions
#   gpu       3   pytest -m gpu: every kernel against its reference on CUDA tensors
#   suite     8   the default suite (pytest, in parallel with pytest-xdist when installed)
#   bench     8   every perf/bench_<op>.py (each kernel against its floor and the torch composite)
#   autotune  5   perf/autotune.py for ResNet-18 and BERT-base
#   e2e       4   perf/bench_optimizer_step.py at the demo's and ResNet-18 size
#   anchors   4   perf/bench_anchors.py beside the authors' code, one run per size in ANCHOR_SIZES
#                 (default: demo cnn resnet18; make anchors first, else the pairs are skipped)
# About 33 minutes for all seven; each phase stops after PHASE_TIMEOUT seconds (default 600) and
# never stops the others. A phase may also name one benchmark (bench_ef_topk, ...), to put the
# ones that matter first on a machine lent for less time. DEADLINE (seconds, default none) bounds
# the whole run: each phase gets at most the time left, and phases left when it passes are
# recorded as skipped (exit "skipped" in the summary). Results go to perf/results/<gpu>/ (<gpu>: the device's name, slugified),
# the logs and a summary of every phase (exit status, seconds) to perf/results/<gpu>/logs/.
#   bash perf/gpu_run.sh env gpu suite bench autotune e2e
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
label=$($PY -c 'from perf._harness import device_label; print(device_label())')
LOG_DIR=${LOG_DIR:-perf/results/$label/logs}
mkdir -p "$LOG_DIR"
PHASE_TIMEOUT=${PHASE_TIMEOUT:-600}
SUMMARY=$LOG_DIR/summary.tsv
[ -f "$SUMMARY" ] || printf 'phase\texit\tseconds\n' >"$SUMMARY"
xdist=$($PY -c 'import xdist' 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}")

DEADLINE=${DEADLINE:-0}

run() {  # run NAME CMD...: time-limited, logged, never stops the other phases
  local name=$1; shift
  local start=$SECONDS limit=$PHASE_TIMEOUT
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -le 5 ]; then
      echo "== $name: skipped, the DEADLINE of $DEADLINE s has passed"
      printf '%s\tskipped\t0\n' "$name" >>"$SUMMARY"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name: $* (at most $limit s)"
  timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$SUMMARY"
  tail -n 15 "$LOG_DIR/$name.log"
}

for phase in "$@"; do
  case $phase in
    env)
      { nvidia-smi; $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'; } >"$LOG_DIR/env.log" 2>&1
      cat "$LOG_DIR/env.log" | tail -n 3 ;;
    gpu) run pytest_gpu $PY -m pytest -q $xdist -m gpu -p no:cacheprovider --junitxml="$LOG_DIR/pytest_gpu.xml" ;;
    suite) run pytest_suite $PY -m pytest -q $xdist -p no:cacheprovider --junitxml="$LOG_DIR/pytest_suite.xml" ;;
    bench)
      # Every kernel and layer benchmark there is (not the optimizer-step one, which is e2e, nor
      # bench_anchors, which needs the authors' checkouts).
      for path in perf/bench_*.py; do
        b=$(basename "$path" .py)
        case $b in bench_optimizer_step|bench_anchors) continue ;; esac
        run "$b" $PY -m "perf.$b"
      done ;;
    bench_*)
      [ -f "perf/$phase.py" ] || { echo "unknown phase $phase"; exit 2; }
      run "$phase" $PY -m "perf.$phase" ;;
    autotune) run autotune $PY -m perf.autotune --model resnet18 bert-base ;;
    e2e) run e2e $PY -m perf.bench_optimizer_step --sizes demo resnet18 ;;
    anchors)
      # One run per size, each to its own folder, so a size cut off by the deadline loses only
      # its own table.
      for size in ${ANCHOR_SIZES:-demo cnn resnet18}; do
        run "anchors_$size" $PY -m perf.bench_anchors --sizes "$size" --anchors "${ANCHORS_DIR:-.anchors}" \
          --out "perf/results/$label/anchors/$size"
      done ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
