#!/usr/bin/env bash
# The CUDA path on a real NVIDIA GPU: install, the CUDA tests, the round trip and the transfer benchmarks.
#
# Run on a GPU machine whose Python already has a CUDA build of torch, msgpack and pytest (pyzmq and
# stevedore come as wheels in .whl/ where the machine has no package registry; see docs/cuda.md):
#   bash ci/gpu.sh [LOG_DIR] [STEPS]
# STEPS (default all): any of install,roundtrip,ipc-exit,bench,bench-load,bench-shm,tests,suite, comma-separated;
# and, only when named (the default list already fills more than one 10-minute call), issue 50's sync probes,
# which run right after install (on a quiet GPU):
# probe-before (ci/gpu_sync_probe_before.py against hwsync before the replay work, .gpu-before/site, which
# ci/gpu-before.sh makes where .git is: carry it) and probe (ci/gpu_sync_probe.py, today's tree); each writes
# LOG_DIR/<step>/probe.json. HWSYNC_GPU_PROBE_GB (default 4.02) and HWSYNC_GPU_PROBE_SYNCS (default 8) size them.
# The benchmarks run before the tests, on a quiet GPU; PYTEST_WORKERS=N runs the tests on N pytest-xdist workers
# (bring pytest-xdist and execnet as wheels in .whl/ too).
# With verl installed (its wheel in .whl/, installed without its dependencies), `bench` also runs verl's own
# colocated sender on the same state dict (hwsync bench transfer --peer verl).
# Every step runs under its own time limit and the script goes on after a failure, so one run shows
# everything; each step's log lands in LOG_DIR (default ./gpu-logs) and the summary in LOG_DIR/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-gpu-logs}
STEPS=${2:-install,roundtrip,ipc-exit,bench,bench-load,bench-shm,tests,suite}
GB=${HWSYNC_GPU_BENCH_GB:-4}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 HWSYNC_BACKEND=cuda
PY=${PYTHON:-python3}
summary() { echo "$*" | tee -a "$LOG/summary.txt"; }
step() {  # step NAME LIMIT_S COMMAND...: run one step, log it, record its exit status
  local name=$1 limit=$2; shift 2
  [[ ",$STEPS," == *",$name,"* ]] || return 0
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  summary "$name: exit $rc in $((SECONDS - t0)) s"
  tail -n 25 "$LOG/$name.log"
}

wheels=()
[ -d .whl ] && wheels=(.whl/*.whl)
step install 300 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation "${wheels[@]}" \
  -e . -e backends/cpu -e backends/cuda -e backends/npu -e tools -e tests/plugins/hwsync_sim
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  "$PY" -m hwsync.cli info
  "$PY" -m pip list 2>/dev/null | grep -iE '^(verl|pyzmq|stevedore|numba|msgpack) '; } >"$LOG/machine.txt" 2>&1
cat "$LOG/machine.txt"
# issue 50's "before": the old probe, unmodified, on the old tree; run from / so that only PYTHONPATH and the
# installed (today's) dists are on the path, and the log says which hwsync and which cuda backend were imported
PROBE_GB=${HWSYNC_GPU_PROBE_GB:-4.02} PROBE_SYNCS=${HWSYNC_GPU_PROBE_SYNCS:-8}
probe_before() {
  local old=$PWD/.gpu-before/site
  [ -f .gpu-before/REV ] || { echo "no .gpu-before/: run bash ci/gpu-before.sh where .git is, and carry .gpu-before"
                              return 2; }
  echo "hwsync before the replay work: $(cat .gpu-before/REV)"
  (cd / && PYTHONPATH=$old "$PY" -c 'import hwsync, hwsync_cuda, sys
print("imports", hwsync.__file__, hwsync_cuda.__file__)
sys.exit(not all(m.__file__.startswith(sys.argv[1]) for m in (hwsync, hwsync_cuda)))' "$old") || return 3
  PYTHONPATH=$old GB=$PROBE_GB SYNCS=$PROBE_SYNCS "$PY" ci/gpu_sync_probe_before.py "$LOG/probe-before"
}
export PY LOG PROBE_GB PROBE_SYNCS
export -f probe_before
step probe-before 240 bash -c probe_before
step probe 300 env GB="$PROBE_GB" SYNCS="$PROBE_SYNCS" "$PY" ci/gpu_sync_probe.py "$LOG/probe"
step roundtrip 90 "$PY" -m hwsync.cli roundtrip
# which export keeps torch's "Producer process has been terminated..." warning at exit (docs/cuda.md)
step ipc-exit 240 "$PY" ci/gpu_ipc_exit.py
peer=()
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("verl") is None)' && peer=(--peer verl)
step bench 300 "$PY" -m hwsync.cli bench transfer --gb "$GB" --syncs 6 --receive into --json "${peer[@]}"
step bench-load 240 "$PY" -m hwsync.cli bench transfer --gb "$GB" --syncs 6 --receive load --source packed --json
step bench-shm 240 "$PY" -m hwsync.cli bench transfer --gb "$GB" --syncs 6 --transport shm --json
workers=()
[ -n "${PYTEST_WORKERS:-}" ] && workers=(-n "$PYTEST_WORKERS")
# the CUDA-only files, then every backend-parametrized test's cuda case
step tests 300 "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" --timeout 120 -rs \
  tests/test_cuda_backend.py tests/test_cuda_ipc.py tests/test_cuda_expandable_segments.py tests/test_offload.py \
  tests/test_transfer.py tests/test_into.py -k "cuda or gpu or not (cpu or sim or npu)"
step suite 330 "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" --timeout 120 -rs tests -k "cuda" \
  --ignore=tests/test_cuda_backend.py --ignore=tests/test_cuda_ipc.py \
  --ignore=tests/test_cuda_expandable_segments.py --ignore=tests/test_offload.py \
  --ignore=tests/test_transfer.py --ignore=tests/test_into.py
cat "$LOG/summary.txt"
