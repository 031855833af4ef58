#!/usr/bin/env bash
# One pass of the GPU checks on a CUDA machine, for the phases named on the command line:
#   env      nvidia-smi, versions
#   gpu      pytest -m gpu
#   suite    the default suite (pytest, in parallel with pytest-xdist when installed)
#   bench    every perf/bench_<op>.py
#   autotune perf/autotune.py for ResNet-18 and BERT-base
#   e2e      perf/bench_optimizer_step.py (every optimizer's step at the demo's and ResNet-18 size)
# Logs go to $LOG_DIR (default perf/results/<gpu>/logs); results to perf/results/<gpu>/.
#   bash perf/gpu_run.sh env gpu suite bench autotune e2e
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
label=$($PY -c 'from perf._harness import device_label; print(device_label())')
LOG_DIR=${LOG_DIR:-perf/results/$label/logs}
mkdir -p "$LOG_DIR"
PHASE_TIMEOUT=${PHASE_TIMEOUT:-300}
xdist=$($PY -c 'import xdist' 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}")

run() {  # run NAME CMD...: time-limited, logged, never stops the other phases
  local name=$1; shift
  local start=$SECONDS
  echo "== $name: $*"
  timeout "$PHASE_TIMEOUT" "$@" >"$LOG_DIR/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  tail -n 15 "$LOG_DIR/$name.log"
}

for phase in "$@"; do
  case $phase in
    env)
      { nvidia-smi; $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'; } >"$LOG_DIR/env.log" 2>&1
      cat "$LOG_DIR/env.log" | tail -n 3 ;;
    gpu) run pytest_gpu $PY -m pytest -q -m gpu -p no:cacheprovider --junitxml="$LOG_DIR/pytest_gpu.xml" ;;
    suite) run pytest_suite $PY -m pytest -q $xdist -p no:cacheprovider --junitxml="$LOG_DIR/pytest_suite.xml" ;;
    bench)
      for b in ef_topk sparse_ring lowrank kfac lanczos sgd_momentum; do
        run bench_$b $PY -m perf.bench_$b
      done ;;
    autotune) run autotune $PY -m perf.autotune --model resnet18 bert-base ;;
    e2e) run e2e $PY -m perf.bench_optimizer_step ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
